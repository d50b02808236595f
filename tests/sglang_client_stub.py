"""SGLang's client-side `CustomLogitProcessor` in SGLang's shape, written as the module file
`sglang/srt/sampling/custom_logit_processor.py` under a directory, so that a test process
imports it as a client with SGLang installed does (dill then pickles a subclass's base by
reference to SGLang's module, as SGLang's own `to_str()` does). Tandem does not depend on
sglang: the server resolves that module to tandem.sampling.custom_logit_processor."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

MODULE = "sglang.srt.sampling.custom_logit_processor"

SOURCE = """
import json
from abc import ABC, abstractmethod

import dill


class CustomLogitProcessor(ABC):
    @abstractmethod
    def __call__(self, logits, custom_param_list=None):
        raise NotImplementedError

    @classmethod
    def to_str(cls) -> str:
        return json.dumps({"callable": dill.dumps(cls).hex()})
"""


def write_package(root: Path) -> None:
    package = root.joinpath(*MODULE.split(".")[:-1])
    package.mkdir(parents=True, exist_ok=True)
    for d in (package, package.parent, package.parent.parent):
        (d / "__init__.py").write_text("")
    (package / "custom_logit_processor.py").write_text(SOURCE)


def _forget() -> None:
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


@contextlib.contextmanager
def sglang_client(root: Path):
    """SGLang's CustomLogitProcessor class, importable while the block runs."""
    write_package(root)
    _forget()
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(MODULE).CustomLogitProcessor
    finally:
        sys.path.remove(str(root))
        _forget()
