"""Sampled-token logprobs from vLLM's engine core to its API servers as bytes, not numpy arrays.

vLLM 0.26-0.27 sends each running request's new logprobs every step as three small numpy arrays (token ids,
logprobs, ranks: `LogprobsLists.slice_request`). Its msgpack encoder in the engine core and decoder in the API
server call a Python hook for every array, so a step with logprobs costs a hook pair per array on each side
of the wire. Measured with vLLM's own encoder and decoder on the 2-core development machine (a step's
`EngineCoreOutputs` for 256 requests, one new token each; docs/gpu-results.md): encoding 1.6-1.8 ms and
decoding 3.2-3.7 ms with logprobs, against 0.03 ms and 0.07 ms without. The engine core is one Python thread,
so that time comes off every step.

Here the engine core sends each request's rows as bytes cut from one buffer per array per step, which msgpack
carries without a hook, and the API server's `LogprobsProcessor` gets back the lists it would have made from
the arrays (`tolist()`), so every value it builds (`Logprob`, ranks, the cumulative logprob) is the same:
token ids and ranks as 64-bit integers and logprobs as 64-bit floats, widened from the engine's dtypes
without rounding. Both processes of one vLLM server load the plugin with the same environment, so both
sides switch together; the layout is native-endian, as vLLM's own arrays are.

A call that carries `"vllm_xargs": {"rolltap_ids_only": 1}` (the proxy's mark on logprobs it asked for itself,
with `return_tokens_as_token_ids`) gets its logprobs' tokens undecoded: its `LogprobsProcessor` has no
tokenizer, so it skips vLLM's per-position `convert_ids_to_tokens` and token check, and the chat layer answers
`token_id:N` with `bytes: null` instead of building each token's bytes. The record keeps token IDs and
logprobs, never the strings; the values are vLLM's own. A call without the mark is untouched.

`ROLLTAP_VLLM_LOGPROBS_WIRE`: `auto` (default: on for the vLLM versions this was checked against, 0.26 and 0.27),
`bytes` (on for any vLLM whose classes look as this module expects) or `numpy` (vLLM's own transport). A vLLM
it does not switch keeps its own transport and says why once; `numpy` also decodes marked calls' tokens.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm.rolltap_vllm")

ENV_WIRE = "ROLLTAP_VLLM_LOGPROBS_WIRE"
_FIELDS = ("logprob_token_ids", "logprobs", "sampled_token_ranks", "cu_num_generated_tokens")
_INSTALLED = "_rolltap_logprobs_wire"
# `vllm_xargs` key (SamplingParams.extra_args) of a call whose logprobs' tokens need no decoding; the proxy
# writes the same string (proxy/formats/openai.py, for chat and completions), a test holds the two together.
IDS_ONLY_XARG = "rolltap_ids_only"
# The vLLM releases whose engine core, serializer and logprob processor this was read and tested against.
CHECKED = ("0.26.", "0.27.")


class _Row(list[Any]):
    """One position's ids or logprobs, as `ndarray.tolist()` would give them to vLLM's processor."""

    __slots__ = ()

    def tolist(self) -> list[Any]:
        return self


class _Rank(int):
    """One position's rank, as `ndarray.tolist()` of a 0-d row gives it."""

    __slots__ = ()

    def tolist(self) -> int:
        return int(self)


def install() -> bool:
    """Switch this process's side of the transport; True when it is on. Called by the plugin's `register`."""
    mode = (os.environ.get(ENV_WIRE) or "auto").strip().lower()
    if mode == "numpy":
        return False
    if mode not in ("auto", "bytes"):
        raise RuntimeError(f"{ENV_WIRE}={mode!r}: want auto, bytes or numpy")
    try:
        import vllm
        from vllm.v1.engine.logprobs import LogprobsProcessor
        from vllm.v1.outputs import LogprobsLists
    except ImportError:  # a vLLM without the v1 engine: nothing to change
        return False
    if getattr(LogprobsLists, _INSTALLED, False):
        return True
    version = str(getattr(vllm, "__version__", ""))
    if mode == "auto" and not version.startswith(CHECKED):
        logger.warning("rolltap: vLLM %s is not one the logprob transport was checked against (%s); keeping "
                       "its own (%s=bytes switches it anyway)", version, ", ".join(v + "x" for v in CHECKED), ENV_WIRE)
        return False
    if (LogprobsLists._fields != _FIELDS or not callable(getattr(LogprobsProcessor, "_update_sample_logprobs", None))
            or not callable(getattr(LogprobsProcessor, "from_new_request", None))):
        logger.warning("rolltap: this vLLM's logprob classes differ from 0.26-0.27's; keeping its own transport")
        return False
    _patch(LogprobsLists, LogprobsProcessor)
    return True


def installed() -> bool:
    """Whether this process's LogprobsLists carries the bytes transport (the plugin's `install` switched it)."""
    try:
        from vllm.v1.outputs import LogprobsLists
    except ImportError:
        return False
    return bool(getattr(LogprobsLists, _INSTALLED, False))


def _patch(lists: Any, processor: Any) -> None:
    import numpy as np

    # The step's LogprobsLists and its three buffers, made once per step. Keyed by identity: the scheduler
    # slices one step's object for all its requests before it builds the next step's, and the reference held
    # here keeps that object alive, so a new step's object can never reuse the cached one's id (objects that alternated would only be cut again).
    cut: list[Any] = [None, None]

    def slice_request(self: Any, req_idx: int, num_positions: int) -> Any:
        if self.cu_num_generated_tokens is not None:  # speculative decoding: rows per request differ
            req_idx = self.cu_num_generated_tokens[req_idx]
        owner, buffers = cut
        if owner is not self:
            ids = np.ascontiguousarray(self.logprob_token_ids, dtype=np.int64)
            buffers = (ids.tobytes(), np.ascontiguousarray(self.logprobs, dtype=np.float64).tobytes(),
                       np.ascontiguousarray(self.sampled_token_ranks, dtype=np.int64).tobytes(),
                       8 * (ids.shape[1] if ids.ndim == 2 else 1))
            cut[:] = (self, buffers)
        ids_b, logprobs_b, ranks_b, row = buffers
        start, end = req_idx * row, (req_idx + num_positions) * row
        return lists(ids_b[start:end], logprobs_b[start:end], ranks_b[req_idx * 8:(req_idx + num_positions) * 8], None)

    original = processor._update_sample_logprobs

    def update_sample_logprobs(self: Any, logprobs_lists: Any) -> None:
        if isinstance(logprobs_lists.sampled_token_ranks, bytes):
            logprobs_lists = _unpack(lists, logprobs_lists)
        original(self, logprobs_lists)

    original_new = processor.from_new_request.__func__

    def from_new_request(cls: Any, tokenizer: Any, request: Any) -> Any:
        params = request.sampling_params
        if params is not None and params.extra_args and params.extra_args.get(IDS_ONLY_XARG):
            tokenizer = None  # vLLM's own path for a server without a tokenizer: positions' tokens stay None
        return original_new(cls, tokenizer, request)

    lists.slice_request = slice_request
    processor.from_new_request = classmethod(from_new_request)
    # msgspec builds the API server's decoder from these annotations when it starts (after plugins load):
    # bytes arrive as bytes, and a numpy payload from an engine without the plugin fails loudly.
    for field in _FIELDS[:3]:
        lists.__annotations__[field] = bytes
    processor._update_sample_logprobs = update_sample_logprobs
    setattr(lists, _INSTALLED, True)
    logger.info("rolltap: sampled logprobs travel from the engine core as bytes, and calls marked %s skip "
                "decoding their tokens (%s=numpy: vLLM's own)", IDS_ONLY_XARG, ENV_WIRE)


def _unpack(lists: Any, packed: Any) -> Any:
    ranks = memoryview(packed.sampled_token_ranks).cast("q").tolist()
    ids = memoryview(packed.logprob_token_ids).cast("q").tolist()
    logprobs = memoryview(packed.logprobs).cast("d").tolist()
    positions = len(ranks)
    if positions == 1:
        return lists([_Row(ids)], [_Row(logprobs)], [_Rank(ranks[0])], None)
    width = len(ids) // positions if positions else 0
    cuts = range(0, positions * width, width) if width else ()
    return lists([_Row(ids[i:i + width]) for i in cuts], [_Row(logprobs[i:i + width]) for i in cuts],
                 [_Rank(rank) for rank in ranks], None)
