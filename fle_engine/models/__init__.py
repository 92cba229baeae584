"""One module per architecture, named after its ``general.architecture``
string; each defines ``ModelArgs`` and ``Transformer`` (with
``Transformer.from_weights``). The registry is just an import by name, so a
new architecture is a new file here and nothing else."""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from fle_quant.errors import FleError


def available() -> list[str]:
    """Architectures this package implements (helper modules such as an
    architecture's MTP head, ``<arch>_mtp``, are not architectures)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if not m.name.startswith("_") and not m.name.endswith("_mtp"))


def get_arch(arch: str, path: object = None) -> ModuleType:
    """The module implementing ``arch``; FleError for an unsupported one."""
    if not isinstance(arch, str) or not arch.isidentifier() or arch not in available():
        where = f"{path}: " if path is not None else ""
        raise FleError(f"{where}architecture {arch!r} is not supported by fle_engine; "
                       f"supported: {', '.join(available())}")
    return importlib.import_module(f"{__name__}.{arch}")
