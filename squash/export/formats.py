"""A recipe's ``export`` block: which files a run writes beside its checkpoints
(``{gguf: [f16, q8_0]}``), checked before training starts. The ``gguf`` package is loaded only
to check a block that asks for GGUF against the model's family."""

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from squash.export.hf_files import GGUF_DTYPES, read_json

__all__ = ["parse_export_config"]


def parse_export_config(block: Any, source_dir: Optional[Path] = None) -> Dict[str, List[str]]:
    """A recipe's ``export`` config block (``{gguf: [f16, q8_0]}``, a single dtype string, or
    None) as ``{"gguf": [dtypes]}``, checked before training starts; with ``source_dir`` (the
    base checkpoint's directory) also that its model family can be exported.

    Raises:
        ValueError: an unknown format or dtype, naming the ``export`` key.
        UnsupportedModelError: a family GGUF export does not support, naming the ``export`` key.
    """
    out = _parse_export_block(block)
    config = Path(source_dir) / "config.json" if source_dir is not None else None
    if out and config is not None and config.is_file():
        from squash.export.gguf import UnsupportedModelError, _hparams  # loads gguf

        try:
            _hparams(read_json(config))
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"export: {e}") from e
    return out


def _parse_export_block(block: Any) -> Dict[str, List[str]]:
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise ValueError(f"export: expected a mapping such as {{gguf: [f16, q8_0]}}, got {block!r}")
    unknown = sorted(set(block) - {"gguf"})
    if unknown:
        # export={gguf:f16} on the command line reads as the key 'gguf:f16' (no space after ':')
        hint = "; on the command line write export.gguf=f16 or 'export.gguf=[f16,q8_0]'" if any(
            ":" in str(k) for k in unknown
        ) else ""
        raise ValueError(f"export: unknown format(s) {unknown}; known: ['gguf']{hint}")
    dtypes = block.get("gguf") or []
    dtypes = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    bad = [d for d in dtypes if d not in GGUF_DTYPES]
    if bad:
        raise ValueError(f"export.gguf: unknown dtype(s) {bad}; known: {list(GGUF_DTYPES)}")
    return {"gguf": dtypes} if dtypes else {}
