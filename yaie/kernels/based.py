# Lesson 08 exercises: replace each `raise NotImplementedError(...)` with your code.
# The given code these exercises use is in yaie/kernels/based_given.py: read it, do not edit it.
# Run `pytest grader/lesson08` to grade them; the notebook is lessons/08_based_linear_attention/.
# (Generated from solutions/kernels/based.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 08: Based linear attention: the Taylor feature map, a chunked prefill kernel, recurrent decode.

Softmax attention weighs key ``j`` for query ``i`` by ``exp(s_ij)`` with ``s_ij = q_i . k_j / sqrt(d)``.
Linear attention replaces ``exp(q . k)`` by a dot product of *features*, ``phi(q) . phi(k)``. Then the
order of the products can change::

    out_i = sum_j (phi(q_i) . phi(k_j)) v_j / sum_j phi(q_i) . phi(k_j)
          = phi(q_i) @ [sum_j phi(k_j) v_j^T] / phi(q_i) . [sum_j phi(k_j)]

The two sums in brackets are the **state**: a ``[F, d_v]`` matrix and an ``[F]`` vector, whatever the
number of tokens. Decoding a token adds one outer product to the state and reads one row-vector
product from it: constant time and memory per token, where a KV cache grows by one row per token.

Based (Arora et al., 2024) takes the second-order Taylor expansion of ``exp``::

    exp(s) ~ 1 + s + s^2 / 2,        s = q . k / sqrt(d),  d = 16 (the feature dimension)

and writes it as a dot product of three concatenated blocks (``x`` is q or k, ``d^(1/4) = 2``)::

    phi(x) = [ 1,  x / d^(1/4),  vec(x x^T) / (sqrt(2) sqrt(d)) ]      1 + 16 + 256 = 273 features

so that ``phi(q) . phi(k) = 1 + q.k/sqrt(d) + (q.k)^2 / (2 d) = 1 + s + s^2/2``. This weight is
``((1 + s)^2 + 1) / 2 >= 1/2``: every key gets a positive weight, so the normaliser never vanishes.

**Chunked prefill** (task 2). Cut the sequence into chunks of ``C`` tokens. For the queries of chunk
``n`` the keys split in two:

* keys of earlier chunks: their contribution is already summed in the state (the same product
  ``phi(q) @ S`` for every query of the chunk, one ``[C, 273] x [273, d_v]`` matrix product);
* keys of the same chunk: a small causal ``C x C`` tile, ``A = 1 + s + s^2/2`` masked above the
  diagonal, then ``A @ v``: the quadratic form, but only ``C`` wide.

Then the chunk's keys are added to the state (``phi(k)^T @ v``) and the next chunk starts. In the
blocks of ``phi``: the state holds ``sum v`` (order 0), ``sum k v^T`` (order 1) and
``sum (k x k) v^T`` (order 2) for the numerator, and ``count``, ``sum k``, ``sum k x k`` for the
normaliser, all in float32. The kernel never builds ``phi(k)`` in memory: it forms the 256
second-order features of a chunk in registers, ``k_a k_b``, and multiplies them straight away.

**The reference's default route** (``chunk_size=None``). The chunked kernel walks the chunks of a
sequence in order, one program per (sequence, head): 256 programs for 16 sequences of 16 heads, little
parallel work for a large GPU, and each program carries a 273-row state (it spills registers on the
H100). The route cuts the sequence into segments of ``DEFAULT_SEGMENT`` tokens instead::

    1. the state at every segment boundary   (one kernel: each program owns some feature rows of one
                                              head's state and walks the sequence, storing its rows of
                                              the running sums at each boundary, and at the end the
                                              final state)
    2. every query block at once:            the quadratic form over the keys of its own segment
                                              + phi(q) @ (the state before its segment)

The queries of the first segment read no state, so they run in step 1's launch, beside the state
programs (``_based_first_launch_kernel`` in the reference solution, solutions/kernels/based.py); the other
segments' queries are a second launch. On a Hopper GPU (H100, H200) the reference takes step 1 from a Gluon
kernel instead (solutions/kernels/based_hopper.py, lesson 08's "going further"): the same states, its features
built straight in the layout the tensor cores read, in about half the time; every query block then runs in
step 2.

Inside a segment the quadratic form tiles like flash attention but without the running maximum (the
weights are never below 1/2: nothing can overflow the sums); its work per token grows with the segment,
not the sequence. Step 1 is a plain matrix product per tile, ``S^T += V^T phi(K)``, with the features
``k_a k_b`` of a block of rows built in registers. bfloat16 inputs keep the boundary states in bfloat16
(the chunked kernel rounds its state to bfloat16 for its products too) so that step 2 reads them with
one ``[BLOCK_M, 256] x [256, d_v]`` tensor-core product; float16 and float32 inputs keep float32 states.

What the route costs beside the chunked kernel and flash-linear-attention, which choices were measured,
and what bounds it: docs/based_prefill.md.

**Recurrent decode** (task 3): one token updates the state and reads its output from it. In PyTorch that
is some twenty small ops (two feature maps, the outer-product update, the product with the state, the
normaliser), each a kernel launch on a GPU, for very little work at batch 1. Your task 3 may stay in
PyTorch. The reference solution (solutions/kernels/based.py) keeps that form for the CPU
(``based_decode_reference``) and runs the step on CUDA as one Triton kernel per call
(``_based_decode_kernel``: one program per sequence and head walks the 273 rows of its state once, adding
the token and reading the output from the updated rows). docs/based_decode.md counts the engine's kernels.

Layouts: ``q, k [batch, heads, seq, 16]``, ``v [batch, heads, seq, d_v]`` (any strides); the state is
:class:`BasedState` (``kv [batch, heads, 273, d_v]`` and ``k [batch, heads, 273]``, float32).

Tasks: 1 the feature map and the quadratic reference, 2 the chunked Triton prefill, 3 recurrent
decode, 4 input checks (``ValueError``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/based_given.py
from yaie.kernels.based_given import (
    BasedState, DEFAULT_CHUNK, DEFAULT_SEGMENT, EXPANDED_DIM, FEATURE_DIM, MAX_VALUE_DIM, SUPPORTED_DTYPES,
    empty_state, state_bytes,
)


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """The Based feature map: ``[..., 16] -> [..., 273]`` with ``phi(q) . phi(k) = 1 + s + s^2/2``.

    ``s = q . k / sqrt(16)``. The features are the concatenation ``[1, x / 2, vec(x x^T) / (4 sqrt(2))]``:
    one constant, the 16 entries of ``x`` scaled by ``16^(-1/4) = 1/2``, and the 256 products
    ``x_a x_b`` (``a`` major, ``b`` minor, i.e. ``(x[..., :, None] * x[..., None, :]).flatten(-2)``)
    scaled by ``1 / (sqrt(2) * sqrt(16))``.

    Args:
        x: ``[..., 16]`` floating point (any dtype; the result has the same dtype and device).
    Returns:
        ``[..., 273]``.
    Raises:
        ValueError: ``x`` is not a floating-point tensor, or its last dimension is not 16.
    """
    raise NotImplementedError('lesson 08, task 1: implement taylor_feature_map in yaie/kernels/based.py')


def based_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal Based attention in its quadratic (parallel) form: the naive answer the kernels must give.

    ``w_ij = 1 + s_ij + s_ij^2 / 2`` with ``s_ij = q_i . k_j / sqrt(16)`` for ``j <= i``, 0 above the
    diagonal; ``out_i = sum_j w_ij v_j / sum_j w_ij``. Builds the ``[seq, seq]`` weight matrix (O(n^2)
    memory): for checking, not for long sequences. Computes in the inputs' dtype (call it on float64
    copies to get a reference).

    Args:
        q, k: ``[batch, heads, seq, 16]``; v: ``[batch, heads, seq, d_v]``; one floating dtype.
    Returns:
        ``out [batch, heads, seq, d_v]`` in the inputs' dtype.
    """
    raise NotImplementedError('lesson 08, task 1: implement based_attention_reference in yaie/kernels/based.py')


def based_chunked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, BasedState]:
    """The chunked algorithm of the kernel, in PyTorch (float32 or the inputs' float64): read this first.

    Same results as :func:`based_prefill`: ``(out, final state)``. One loop over chunks; inside a
    chunk the exact causal tile, across chunks the running state.
    """
    batch, heads, seq, _ = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    state_kv = torch.zeros(batch, heads, EXPANDED_DIM, v.shape[-1], dtype=compute, device=q.device)
    state_k = torch.zeros(batch, heads, EXPANDED_DIM, dtype=compute, device=q.device)
    out = torch.empty_like(v)
    for start in range(0, seq, chunk_size):
        end = min(start + chunk_size, seq)
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        fq, fk = taylor_feature_map(qc), taylor_feature_map(kc)            # [b, h, c, 273]
        # Earlier chunks: one product with the state (causality is already settled for them).
        num = fq @ state_kv
        den = (fq * state_k[:, :, None, :]).sum(-1)
        # This chunk: the exact causal tile.
        w = (fq @ fk.transpose(-1, -2)).tril()
        num = num + w @ vc
        den = den + w.sum(-1)
        out[:, :, start:end] = num / den[..., None]
        # Fold this chunk's keys into the state.
        state_kv = state_kv + fk.transpose(-1, -2) @ vc
        state_k = state_k + fk.sum(-2)
    return out, BasedState(state_kv.float(), state_k.float())


def check_based_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: BasedState | None = None,
                       decode: bool = False) -> None:
    """Raise ``ValueError`` unless the arguments suit :func:`based_prefill` (``decode=False``) or
    :func:`based_decode_step` (``decode=True``).

    Prefill: ``q, k [batch, heads, seq, 16]``, ``v [batch, heads, seq, d_v]`` with ``seq >= 1``.
    Decode: one token, ``q, k [batch, heads, 16]``, ``v [batch, heads, d_v]``, and a ``state``
    (:class:`BasedState`: ``kv [batch, heads, 273, d_v]``, ``k [batch, heads, 273]``, float32, same device).
    Always: torch tensors of one floating dtype (float16, bfloat16 or float32) on one device, the
    feature dimension exactly 16 (the kernel is built for it), ``1 <= d_v <= 256``, batch, heads and
    seq equal in q, k and v. CPU tensors for the prefill kernel need the Triton interpreter.
    """
    raise NotImplementedError('lesson 08, task 4: implement check_based_inputs in yaie/kernels/based.py')


def based_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None,
                  return_state: bool = True) -> tuple[torch.Tensor, BasedState | None]:
    """Causal Based attention over whole sequences with the chunked Triton kernel.

    Chunk by chunk: the exact causal ``chunk x chunk`` tile inside the chunk, plus the running state of
    all earlier chunks (sums of ``v``, ``k v^T`` and ``(k x k) v^T`` for the numerator, of ``1``, ``k`` and
    ``k x k`` for the normaliser, in float32). Any length (the last chunk may be partial).
    With ``chunk_size=None`` an implementation may take another route where it is faster; the results
    are the same (the reference cuts the sequence into segments of ``DEFAULT_SEGMENT`` tokens: the
    quadratic form inside a segment, tile by tile, the state between segments; see the module docstring).

    Args:
        q, k: ``[batch, heads, seq, 16]``; v: ``[batch, heads, seq, d_v]`` (d_v up to 256; 64 and 128 are
            the usual ones); one dtype: float16, bfloat16 or float32; any strides; CUDA, or CPU under the
            Triton interpreter.
        chunk_size: tokens per chunk, 16, 32, 64 or 128 (the chunked kernel); ``None``: the implementation's
            choice (the chunked kernel at a chunk size of your choosing will do; the reference: segments).
        return_state: also return the state after the last token (for decoding on).
    Returns:
        ``(out, state)``: ``out [batch, heads, seq, d_v]`` in the inputs' dtype (``out_i`` as in
        :func:`based_attention_reference`); ``state`` a :class:`BasedState` (float32, the layout of
        :func:`taylor_feature_map`), or ``None`` when ``return_state`` is False.
    Raises:
        ValueError: through :func:`check_based_inputs`; a chunk size that is not a power of two in [16, 128].
    """
    raise NotImplementedError('lesson 08, task 2: implement based_prefill in yaie/kernels/based.py')


def based_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: BasedState) -> torch.Tensor:
    """One decode step of Based attention: fold one new token into ``state`` (in place), then read its output.

    ``state.kv += phi(k) v^T``, ``state.k += phi(k)``; ``out = phi(q) @ state.kv / (phi(q) . state.k)``
    (the new token sees itself, as in the causal form). Time and memory do not grow with the number of
    tokens seen. Prefill with :func:`based_prefill` then decode token by token gives the same outputs as
    :func:`based_attention_reference` over the whole sequence.

    Args:
        q, k: ``[batch, heads, 16]``; v: ``[batch, heads, d_v]`` (one token per sequence), one dtype.
        state: a :class:`BasedState` (float32), updated in place.
    Returns:
        ``out [batch, heads, d_v]`` in the inputs' dtype.
    Raises:
        ValueError: through :func:`check_based_inputs` (``decode=True``); the state is left untouched.
    """
    raise NotImplementedError('lesson 08, task 3: implement based_decode_step in yaie/kernels/based.py')
