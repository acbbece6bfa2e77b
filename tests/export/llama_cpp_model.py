"""A GGUF file in llama.cpp itself, through llama-cpp-python's bindings of llama.cpp's C API
(``llama_model_load_from_file``, ``llama_decode``, ``llama_tokenize``, ...), not through a
Python reimplementation: what the llama.cpp tests of the exported files run.

llama.cpp's messages are collected while a file loads, so a test can compare the warnings it
prints for one file with those for another. Weights stay in llama.cpp's plain CPU buffers
(``use_extra_bufts`` off): with its AMX kernels, which ``-march=native`` compiles in on an AMX
host, llama.cpp 0.3.36's batched decode of any quantized file (the upstream SmolLM2 Q4_1 too)
crashed with a segmentation fault on the Xeon host the tests were written on.
"""

import ctypes
from pathlib import Path
from typing import List, Set

import numpy as np

import llama_cpp

_LOG: List[tuple] = []
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 3, 4, 5  # ggml.h


@llama_cpp.llama_log_callback
def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == GGML_LOG_LEVEL_CONT and _LOG:
        _LOG[-1] = (_LOG[-1][0], _LOG[-1][1] + text.decode("utf-8", "replace"))
    else:
        _LOG.append((level, text.decode("utf-8", "replace")))


llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))


class LlamaCppModel:
    """One GGUF file loaded by llama.cpp with a context of ``n_ctx`` tokens, one thread.

    Attributes:
        warnings (List[str]): the warnings and errors llama.cpp logged while loading it.

    Raises:
        RuntimeError: llama.cpp cannot load the file (with its messages).
    """

    def __init__(self, path: Path, n_ctx: int = 1024) -> None:
        _LOG.clear()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False  # see the module docstring
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        messages = list(_LOG)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}:\n" + "".join(t for _, t in messages))
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_outputs_max = cparams.n_outputs_max_per_seq = n_ctx  # logits of every position
        cparams.n_threads = cparams.n_threads_batch = 1
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp cannot make a context for {path}")
        bad = (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR)
        self.warnings = [text.strip() for level, text in messages if level in bad]
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = n_ctx

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def metadata(self, key: str) -> str:
        """A metadata value as llama.cpp reads it, as a string."""
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            raise KeyError(key)
        return buf.value.decode()

    def tokenize(self, text: str) -> List[int]:
        """llama.cpp's tokens of ``text``, special tokens parsed, nothing added."""
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, len(out), False, True)
        assert n >= 0, n
        return list(out[:n])

    def end_of_generation(self) -> Set[int]:
        """The token ids llama.cpp stops generating at."""
        return {i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, i)}

    def _decode(self, ids: List[int], start: int, all_logits: bool) -> None:
        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == len(ids) - 1
            rc = llama_cpp.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            llama_cpp.llama_batch_free(batch)

    def _reset(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def logits(self, ids: List[int]) -> np.ndarray:
        """Next-token logits ``(len(ids), vocab)`` of every position of ``ids``, in one batch."""
        assert len(ids) <= self.n_ctx
        self._reset()
        self._decode(ids, 0, all_logits=True)
        ptr = llama_cpp.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(ids), self.n_vocab)).copy()

    def greedy(self, prompt: List[int], max_new_tokens: int) -> List[int]:
        """Greedy continuation of ``prompt`` with llama.cpp's KV cache, stopping after an
        end-of-generation token (not returned)."""
        self._reset()
        self._decode(prompt, 0, all_logits=False)
        eog, out = self.end_of_generation(), []
        for _ in range(max_new_tokens):
            last = llama_cpp.llama_get_logits_ith(self.ctx, -1)
            row = np.ctypeslib.as_array(last, shape=(self.n_vocab,))
            token = int(np.argmax(row))
            if token in eog:
                break
            out.append(token)
            self._decode([token], len(prompt) + len(out) - 1, all_logits=False)
        return out
