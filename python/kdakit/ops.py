"""torch custom ops over the kdakit C++ API, with fake implementations for torch.compile and the autograd
formula of the chunked forward.

- ``kdakit::chunk_fwd``: functional chunked forward, differentiable (backward: ``kdakit::chunk_bwd``).
- ``kdakit::chunk_fwd_into``: chunked forward into caller buffers: ``out=``, a state pool read and written in
  place through slot indices, intermediate states. No autograd.
- ``kdakit::recurrent_fwd_into``: decode / speculative verify into caller buffers. No autograd.
- ``kdakit::no_backward``: the gradient function of forward-only outputs (`forward_only`): raises when run.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._torch import PRE_GATED, fill_inputs, layout, num_sequences, state_shape, stream_of, view, workspace


def _op_or_impl(op, impl, tracked_inputs: tuple, args: tuple):
    """A call's entry: the custom op where autograd records the call (tracked_inputs: the inputs it would record
    through) or torch.compile traces it, the implementation directly otherwise. The dispatcher's overhead is a share
    of a call's host time, which the GPU waits for whenever it runs ahead (docs/perf-notes.md)."""
    if tracked_inputs or torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)


# ----------------------------------------------------------------------------------------------------------
# Chunked forward, functional and differentiable.


def _run_forward(p, q: Tensor) -> None:
    """One planned call: its workspace, then the launch (validation and planning once)."""
    call = _C.ForwardCall(p)
    ws = workspace(call.workspace_size, q.device)
    call.run(view(ws), stream_of(q))


class _TwoPhaseCall:
    """The workspace of a call run in two halves (kdakit::CpPhase): the summary half plans it and runs, the finish half
    must plan the same bytes and runs on them once."""

    def _run_summary(self, call, like: Tensor) -> None:
        self._ws_size = call.workspace_size
        self._ws = workspace(self._ws_size, like.device)
        call.run(view(self._ws), stream_of(like))
        self._done = False

    def _check_unfinished(self) -> None:
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.finish: already run (its workspace holds the summary call's "
                               "work once)")

    def _run_finish(self, call, like: Tensor) -> None:
        if call.workspace_size != self._ws_size:
            raise RuntimeError(f"{type(self).__name__}.finish: the finish call plans a workspace of "
                               f"{call.workspace_size} bytes, the summary call's was {self._ws_size}")
        call.run(view(self._ws), stream_of(like))
        self._done = True


class SplitForward(_TwoPhaseCall):
    """A forward of one sequence ([1, T, ...], CUDA) in the two halves of a context-parallel run (kdakit::CpPhase).

    Made: the half that does not depend on the start state runs, and `summary` holds the sequence's contribution to
    later ranks, float32 [HV, K, V + K]: its end state from zero, then its transition M (spec §7.2). `finish(h0)`
    (h0 [1, HV, K, V] float32, or None for zero) then runs the rest on the same workspace and returns the output.
    No autograd: forward-only callers."""

    def __init__(self, q, k, v, g, beta, A_log, dt_bias, scale, gate, lower_bound, qk_l2norm, beta_sigmoid,
                 allow_neg_eigval, safe_gate, chunk_size):
        self._inputs = (q, k, v, g, beta, A_log, dt_bias)
        self._opts = (scale, gate, lower_bound, qk_l2norm, beta_sigmoid, allow_neg_eigval)
        self._chunk = (safe_gate, chunk_size)
        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        self.o = q.new_empty((q.shape[0], q.shape[1], HV, V))
        self.summary = torch.empty((HV, K, V + K), dtype=torch.float32, device=q.device)
        p = self._params(None, _C.CpPhase.SUMMARY)
        p.cp_summary = view(self.summary)
        self._run_summary(_C.ForwardCall(p), q)

    def _params(self, h0, phase):
        q, k, v, g, beta, A_log, dt_bias = self._inputs
        p = _C.ForwardParams()
        fill_inputs(p.inputs, q, k, v, g, beta, A_log, dt_bias, None, None, *self._opts)
        p.state.layout = layout(False)
        p.state.initial_state = view(h0)
        p.safe_gate, p.chunk_size = self._chunk
        p.out = view(self.o)
        p.cp_phase = phase
        return p

    def finish(self, h0: Optional[Tensor]) -> Tensor:
        self._check_unfinished()
        self._run_finish(_C.ForwardCall(self._params(h0, _C.CpPhase.FINISH)), self.o)
        return self.o


def _chunk_outputs(q, v, N, output_final_state, num_chunks, state_v_first, varlen, h_dtype):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    ht = q.new_empty(state_shape(N, HV, K, V, state_v_first), dtype=torch.float32) if output_final_state \
        else q.new_empty((0,), dtype=torch.float32)
    if num_chunks >= 0:
        h = q.new_empty((1 if varlen else B, num_chunks) + state_shape(1, HV, K, V, state_v_first)[1:], dtype=h_dtype)
    else:
        h = q.new_empty((0,), dtype=h_dtype)
    return o, ht, h


def _chunk_fwd_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                    dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                    cu_seqlens_cpu: Optional[Tensor], scale: float, gate: int, lower_bound: float, qk_l2norm: bool,
                    beta_sigmoid: bool, allow_neg_eigval: bool, safe_gate: bool, chunk_size: int,
                    state_v_first: bool, output_final_state: bool, num_chunks: int,
                    save_states: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (o, final_state or empty, chunk-start states or empty); num_chunks < 0: no chunk states. save_states:
    the chunk states are float32, for the backward to read instead of recomputing them (disable_recompute)."""
    N = num_sequences(q, cu_seqlens)
    o, ht, h = _chunk_outputs(q, v, N, output_final_state, num_chunks, state_v_first, cu_seqlens is not None,
                              torch.float32 if save_states else k.dtype)
    p = _C.ForwardParams()
    fill_inputs(p.inputs, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, scale, gate, lower_bound,
                qk_l2norm, beta_sigmoid, allow_neg_eigval)
    p.state.layout = layout(state_v_first)
    p.state.initial_state = view(initial_state)
    if output_final_state:
        p.state.final_state = view(ht)
    p.chunk_size = chunk_size
    p.safe_gate = safe_gate
    p.out = view(o)
    if num_chunks >= 0:
        p.intermediate_states = view(h)
    _run_forward(p, q)
    return o, ht, h


chunk_fwd = torch.library.custom_op("kdakit::chunk_fwd", _chunk_fwd_impl, mutates_args=())


def chunk_forward(tracked_inputs: tuple, *args):
    """Chunked forward entry (_op_or_impl)."""
    return _op_or_impl(torch.ops.kdakit.chunk_fwd, _chunk_fwd_impl, tracked_inputs, args)


@chunk_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, gate, lower_bound,
      qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size, state_v_first, output_final_state, num_chunks,
      save_states):
    N = num_sequences(q, cu_seqlens)
    return _chunk_outputs(q, v, N, output_final_state, num_chunks, state_v_first, cu_seqlens is not None,
                          torch.float32 if save_states else k.dtype)


def _grad_like(x: Optional[Tensor], like: Tensor) -> Tensor:
    return torch.empty_like(x) if x is not None else like.new_empty((0,))


def _backward_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, d_out, d_final_state, scale, gate,
                     lower_bound, qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size, state_v_first):
    """A BackwardParams with the inputs, options and cotangents (the gradients and state inputs are the caller's)."""
    p = _C.BackwardParams()
    fill_inputs(p.inputs, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, scale, gate, lower_bound,
                qk_l2norm, beta_sigmoid, allow_neg_eigval)
    p.layout = layout(state_v_first)
    p.chunk_size = chunk_size
    p.safe_gate = safe_gate
    p.d_out = view(d_out)
    p.d_final_state = view(d_final_state)
    return p


@torch.library.custom_op("kdakit::chunk_bwd", mutates_args=())
def chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
              dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
              cu_seqlens_cpu: Optional[Tensor], d_out: Tensor, d_final_state: Optional[Tensor],
              chunk_states: Optional[Tensor], scale: float, gate: int, lower_bound: float, qk_l2norm: bool,
              beta_sigmoid: bool, allow_neg_eigval: bool, safe_gate: bool, chunk_size: int,
              state_v_first: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, d_initial_state); absent ones are empty. chunk_states: the
    forward's saved chunk-start states (float32), read instead of recomputed, or None."""
    p = _backward_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, d_out, d_final_state, scale,
                         gate, lower_bound, qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size,
                         state_v_first)
    p.initial_state = view(initial_state)
    p.chunk_states = view(chunk_states)
    grads = _gradient_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state, gate)
    call = _C.BackwardCall(p)
    ws = workspace(call.workspace_size, q.device)
    call.run(view(ws), stream_of(q))
    return grads


def _gradient_outputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state, gate):
    """A backward call's gradient outputs, allocated and set on p: (dq, dk, dv, dg, dbeta, dA_log, ddt_bias,
    d_initial_state), the absent ones empty."""
    gate_in_kernel = gate != PRE_GATED
    dq, dk, dv, dg, db = (torch.empty_like(x) for x in (q, k, v, g, beta))
    dA = _grad_like(A_log if gate_in_kernel else None, q)
    dbias = _grad_like(dt_bias if gate_in_kernel else None, q)
    dh0 = _grad_like(initial_state, q)
    p.dq, p.dk, p.dv, p.dg, p.dbeta = view(dq), view(dk), view(dv), view(dg), view(db)
    if A_log is not None and gate_in_kernel:
        p.dA_log = view(dA)
    if dt_bias is not None and gate_in_kernel:
        p.ddt_bias = view(dbias)
    if initial_state is not None:
        p.d_initial_state = view(dh0)
    return dq, dk, dv, dg, db, dA, dbias, dh0


@chunk_bwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, d_out, d_final_state,
      chunk_states, scale, gate, lower_bound, qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size,
      state_v_first):
    gate_in_kernel = gate != PRE_GATED
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta),
            _grad_like(A_log if gate_in_kernel else None, q), _grad_like(dt_bias if gate_in_kernel else None, q),
            _grad_like(initial_state, q))


@torch.library.custom_op("kdakit::chunk_bwd_initial_state", mutates_args=())
def chunk_bwd_initial_state(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                            dt_bias: Optional[Tensor], cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor],
                            d_out: Tensor, d_final_state: Optional[Tensor], scale: float, gate: int,
                            lower_bound: float, qk_l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool,
                            safe_gate: bool, chunk_size: int, state_v_first: bool) -> Tensor:
    """The gradient with respect to every sequence's initial state alone (float32 [N, HV, K, V], or v-first): it
    depends on neither the state's value nor v (kdakit::BackwardParams::d_initial_state_only)."""
    N = num_sequences(q, cu_seqlens)
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    dh0 = q.new_empty(state_shape(N, HV, K, V, state_v_first), dtype=torch.float32)
    p = _backward_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, d_out, d_final_state, scale,
                         gate, lower_bound, qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size,
                         state_v_first)
    p.d_initial_state = view(dh0)
    p.d_initial_state_only = True
    call = _C.BackwardCall(p)
    ws = workspace(call.workspace_size, q.device)
    call.run(view(ws), stream_of(q))
    return dh0


@chunk_bwd_initial_state.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, d_out, d_final_state, scale, gate, lower_bound,
      qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size, state_v_first):
    N = num_sequences(q, cu_seqlens)
    return q.new_empty(state_shape(N, v.shape[2], k.shape[3], v.shape[3], state_v_first), dtype=torch.float32)


class SplitBackward(_TwoPhaseCall):
    """A backward of one sequence ([1, T, ...], CUDA) in the two halves of a context-parallel run
    (kdakit::BackwardParams::cp_phase).

    Made: the half that does not depend on d_final_state runs (the forward's recompute, the reverse scan's segments),
    and with want_initial `d_initial` holds the gradient with respect to the initial state for a zero d_final_state,
    float32 [1, HV, K, V] (the rank's E of spec §7.4; else None). `finish(d_final_state)` then runs the rest on the
    same workspace and returns chunk_bwd's tuple. `opts`: chunk_bwd's scale .. chunk_size. No autograd: the caller's
    backward."""

    def __init__(self, q, k, v, g, beta, A_log, dt_bias, initial_state, d_out, chunk_states, want_initial, *opts):
        self._inputs = (q, k, v, g, beta, A_log, dt_bias)
        self._initial, self._d_out, self._states, self._opts = initial_state, d_out, chunk_states, opts
        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        self.d_initial = q.new_empty((1, HV, K, V), dtype=torch.float32) if want_initial else None
        p = self._params(None, _C.CpPhase.SUMMARY)
        p.d_initial_state = view(self.d_initial)
        self._run_summary(_C.BackwardCall(p), q)

    def _params(self, d_final_state, phase):
        p = _backward_params(*self._inputs, None, None, self._d_out, d_final_state, *self._opts, False)
        p.initial_state = view(self._initial)
        p.chunk_states = view(self._states)
        p.cp_phase = phase
        return p

    def finish(self, d_final_state: Optional[Tensor]):
        self._check_unfinished()
        p = self._params(d_final_state, _C.CpPhase.FINISH)
        grads = _gradient_outputs(p, *self._inputs, self._initial, self._opts[1])
        self._run_finish(_C.BackwardCall(p), self._d_out)
        self._ws = None
        return grads


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *args) = inputs
    save_states = args[-1]
    h = output[2] if save_states else None  # float32 chunk states, saved (disable_recompute)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, h)
    ctx.args = args  # scale, gate, lower_bound, qk_l2norm, beta_sigmoid, neg, safe, chunk, v_first, final, chunks, save


def _backward(ctx, d_out, d_final_state, d_h):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, h = ctx.saved_tensors
    (scale, gate, lower_bound, qk_l2norm, beta_sigmoid, neg, safe, chunk_size, v_first, output_final_state,
     _num_chunks, _save_states) = ctx.args
    if not output_final_state:
        d_final_state = None
    dq, dk, dv, dg, db, dA, dbias, dh0 = chunk_bwd(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, d_out.contiguous(),
        d_final_state.contiguous() if d_final_state is not None else None, h, scale, gate, lower_bound, qk_l2norm,
        beta_sigmoid, neg, safe, chunk_size, v_first)
    gate_in_kernel = gate != PRE_GATED
    return (dq, dk, dv, dg, db,
            dA if (A_log is not None and gate_in_kernel) else None,
            dbias if (dt_bias is not None and gate_in_kernel) else None,
            dh0 if initial_state is not None else None,
            None, None) + (None,) * 12


torch.library.register_autograd("kdakit::chunk_fwd", _backward, setup_context=_setup_context)

# ----------------------------------------------------------------------------------------------------------
# Chunked forward into caller buffers (serving prefill).


def _chunk_fwd_into_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                         dt_bias: Optional[Tensor], initial_state: Optional[Tensor], out: Tensor,
                         final_state: Optional[Tensor], intermediate_states: Optional[Tensor],
                         cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor],
                         state_indices: Optional[Tensor], has_initial_state: Optional[Tensor], pad_slot_id: int,
                         final_is_initial: bool, scale: float, gate: int, lower_bound: float, qk_l2norm: bool,
                         beta_sigmoid: bool, allow_neg_eigval: bool, safe_gate: bool, chunk_size: int,
                         state_v_first: bool) -> None:
    """final_is_initial: final_state is a pool that is also read (initial_state must then be None)."""
    p = _C.ForwardParams()
    fill_inputs(p.inputs, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, scale, gate, lower_bound,
                qk_l2norm, beta_sigmoid, allow_neg_eigval)
    _C.set_state(p.state, state_v_first, final_state if final_is_initial else initial_state, final_state,
                 state_indices, has_initial_state, pad_slot_id)
    p.chunk_size = chunk_size
    p.safe_gate = safe_gate
    p.out = view(out)
    p.intermediate_states = view(intermediate_states)
    _run_forward(p, q)


chunk_fwd_into = torch.library.custom_op("kdakit::chunk_fwd_into", _chunk_fwd_into_impl,
                                         mutates_args=("out", "final_state", "intermediate_states"))


def chunk_forward_into(*args) -> None:
    """Serving prefill entry (no autograd; _op_or_impl)."""
    _op_or_impl(torch.ops.kdakit.chunk_fwd_into, _chunk_fwd_into_impl, (), args)


@chunk_fwd_into.register_fake
def _(*args, **kwargs):
    return None


# ----------------------------------------------------------------------------------------------------------
# Decode / verify into caller buffers.


def _recurrent_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                    dt_bias: Optional[Tensor], initial_state: Optional[Tensor], out: Tensor,
                    final_state: Optional[Tensor], token_states: Optional[Tensor], cu_seqlens: Optional[Tensor],
                    state_indices: Optional[Tensor], num_accepted_tokens: Optional[Tensor],
                    has_initial_state: Optional[Tensor], pad_slot_id: int, final_is_initial: bool, scale: float,
                    gate: int, lower_bound: float, qk_l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool,
                    state_v_first: bool) -> None:
    p = _C.DecodeParams()
    fill_inputs(p.inputs, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, None, scale, gate, lower_bound, qk_l2norm,
                beta_sigmoid, allow_neg_eigval)
    _C.set_state(p.state, state_v_first, final_state if final_is_initial else initial_state, final_state,
                 state_indices, has_initial_state, pad_slot_id)
    p.num_accepted_tokens = view(num_accepted_tokens)
    p.out = view(out)
    p.token_states = view(token_states)
    _C.decode(p, stream_of(q))


recurrent_fwd_into = torch.library.custom_op(
    "kdakit::recurrent_fwd_into", _recurrent_impl, mutates_args=("out", "final_state", "token_states"))


@recurrent_fwd_into.register_fake
def _(*args, **kwargs):
    return None


def recurrent_into(*args) -> None:
    """Decode entry (no autograd; _op_or_impl)."""
    _op_or_impl(torch.ops.kdakit.recurrent_fwd_into, _recurrent_impl, (), args)


# ----------------------------------------------------------------------------------------------------------
# Outputs of forward-only calls made with inputs that require grad.


@torch.library.custom_op("kdakit::no_backward", mutates_args=())
def no_backward(like: Tensor, message: str) -> Tensor:
    """Would be the gradient of `like`; raises `message` instead. An op (not a Python raise in the backward) so that
    torch.compile traces the backward graph by its fake and the error comes when a gradient is actually requested."""
    raise RuntimeError(message)


@no_backward.register_fake
def _(like, message):
    return torch.empty_like(like)


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, message: str, n_outputs: int, *tensors):
        ctx.message = message
        ctx.n_outputs = n_outputs
        ctx.save_for_backward(*tensors[n_outputs:])
        return tuple(t.view_as(t) for t in tensors[:n_outputs])

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        return (None, None) + (None,) * ctx.n_outputs + tuple(no_backward(x, ctx.message) for x in inputs)


def forward_only(message: str, inputs: tuple, *outputs):
    """The outputs as they are when no input is tracked by autograd; otherwise views of them attached to the tracked
    inputs by a gradient function that raises `message`, so that a gradient requested through them is an error naming
    the call, never a silent zero. None outputs stay None."""
    if not inputs:
        return outputs
    present = [o for o in outputs if o is not None]
    views = iter(_NoBackward.apply(message, len(present), *present, *inputs))
    return tuple(None if o is None else next(views) for o in outputs)
