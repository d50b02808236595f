"""`--tool-call-parser`: SGLang's parser names and the detector each one selects."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tandem.function_call.base_format_detector import BaseFormatDetector
from tandem.function_call.llama32_detector import Llama32Detector
from tandem.function_call.mistral_detector import MistralDetector
from tandem.function_call.pythonic_detector import Lfm2Detector, PythonicDetector
from tandem.function_call.qwen25_detector import Qwen25Detector

ToolCallParserEnum: Mapping[str, type[BaseFormatDetector]] = MappingProxyType(
    {
        "lfm2": Lfm2Detector,
        "llama3": Llama32Detector,
        "mistral": MistralDetector,
        "pythonic": PythonicDetector,
        "qwen": Qwen25Detector,
        "qwen25": Qwen25Detector,
    }
)
