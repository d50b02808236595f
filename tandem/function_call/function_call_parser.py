"""`--tool-call-parser`: SGLang's parser names and the detector each one selects."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tandem.function_call.base_format_detector import BaseFormatDetector
from tandem.function_call.llama32_detector import Llama32Detector
from tandem.function_call.qwen25_detector import Qwen25Detector

ToolCallParserEnum: Mapping[str, type[BaseFormatDetector]] = MappingProxyType(
    {
        "llama3": Llama32Detector,
        "qwen": Qwen25Detector,
        "qwen25": Qwen25Detector,
    }
)
