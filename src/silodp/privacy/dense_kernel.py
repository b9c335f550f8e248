"""Per-subject clipping of a plain MLP in three compiled calls (numba).

For the chain ``Linear (ReLU Linear)*`` (:class:`~silodp.privacy.dense_chain.DenseChain`) the
arithmetic of a clipped per-subject sum is small: the passes, each subject's squared norm and
one weighted sum per layer. Run as torch operations it is dominated by their fixed cost (a
few hundred calls of ~5 µs each per step on the 4,810-parameter ``mlp``). Here it is three
calls of compiled code, with the matrix products in BLAS:

``passes``
    the forward pass and the backward pass of ``Σ_i CE(f(x_i), y_i)/n_{a(i)}`` (``n_a``: the
    records of ``x_i``'s subject) in the parameters' dtype, as :meth:`DenseChain.capture`
    computes them (``softmax − onehot``, ReLU gradients where the ReLU's output is ``> 0``),
    keeping every layer's inputs ``a`` and output gradients ``g``, the records ordered by
    subject;
``subject_sq``
    every subject's ``Σ_layers ||Σ_{i∈S} g_i ãᵢᵀ||²`` (``ã = [a, 1]`` with a bias) in float64,
    from float64 copies of ``a`` and ``g``: ``||g||²·||ã||²`` for one record, else whichever of
    the Gram sum ``Σ_{i,j∈S} (g_i·g_j)(ã_i·ã_j)`` and the materialised ``Σ_{i∈S} g_i ãᵢᵀ``
    costs fewer products; with ``mag = Σ_{i∈S} Σ_layers ||g_i||·||ã_i||``, the scale of their
    rounding (the caller turns both into upper bounds, see
    :func:`silodp.privacy.ghost._rounded_bounds`);
``release``
    ``Σ_i w_i g_i ãᵢᵀ`` per layer, in the parameters' dtype or, where the caller asks, in
    float64 (then rounded once to the parameters' dtype).

The matrix products run on one BLAS thread. numba's ``np.dot`` calls SciPy's OpenBLAS, which
otherwise splits these small products over every core, and its idle workers then spin for a
while: on the 2-core host a ULDP-SGD run's ``torch.round`` calls took 250 times longer beside
them. The BLAS libraries are set to one thread for each call and restored after
(:class:`_OneBlasThread`, through threadpoolctl).

Records whose subject's bound is not finite are left out of the release entirely (a zero
weight times an infinite input would be NaN). Everything else about the clipped sum (which
bound, which weights, which dtype) is decided by the caller, the same way for this path and
the torch one. The functions are compiled on first use (a few seconds) and cached beside
this module (numba's ``cache=True``), so later processes load them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import numba
import numpy as np
import torch
from torch import nn

from silodp.privacy.chain import Op
from silodp.privacy.gradients import Params

__all__ = ["DenseKernel", "KernelPass"]

#: subjects of at most this many records take the Gram route on every layer
GRAM_ALWAYS = 4


class _OneBlasThread:
    """Holds the process's BLAS libraries (NumPy's and SciPy's) to one thread inside the
    block, then restores their thread counts. One block at a time per process: a thread's
    restore must not change the count while another thread's compiled call is in BLAS."""

    _libraries: list[Any] | None = None
    _lock = threading.Lock()

    def __enter__(self) -> None:
        _OneBlasThread._lock.acquire()
        try:
            libraries = _OneBlasThread._libraries
            if libraries is None:
                import scipy.linalg.cython_blas  # noqa: F401  (the BLAS numba calls, loaded)
                import threadpoolctl

                controller = threadpoolctl.ThreadpoolController()
                libraries = [lib for lib in controller.lib_controllers if lib.user_api == "blas"]
                _OneBlasThread._libraries = libraries
            self._saved = [(lib, lib.get_num_threads()) for lib in libraries]
            for lib, threads in self._saved:
                if threads != 1:
                    lib.set_num_threads(1)
        except BaseException:
            _OneBlasThread._lock.release()
            raise

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        try:
            for lib, threads in self._saved:
                if threads != 1:
                    lib.set_num_threads(threads)
        finally:
            _OneBlasThread._lock.release()


@numba.njit(cache=True, nogil=True)
def _layout(inverse, subjects):  # type: ignore[no-untyped-def]
    """The records grouped by subject, in their order within each (a stable counting sort),
    where each subject's rows start, and the most records of a subject."""
    starts = np.zeros(subjects + 1, dtype=np.int64)
    for i in range(inverse.shape[0]):
        starts[inverse[i] + 1] += 1
    largest = 0
    for u in range(subjects):
        largest = max(largest, starts[u + 1])
        starts[u + 1] += starts[u]
    order = np.empty(inverse.shape[0], dtype=np.int64)
    fill = starts[:subjects].copy()
    for i in range(inverse.shape[0]):
        order[fill[inverse[i]]] = i
        fill[inverse[i]] += 1
    return order, starts, largest


@numba.njit(cache=True, nogil=True)
def _passes(x, y, order, starts, weights, biases, a_buf, g_buf, a_off, g_off):  # type: ignore[no-untyped-def]
    batch = order.shape[0]
    layers = len(weights)
    classes = weights[layers - 1].shape[0]
    for i in range(batch):
        if y[order[i]] < 0 or y[order[i]] >= classes:
            return False
    d = weights[0].shape[1]
    a = a_buf[: batch * d].reshape((batch, d))
    for i in range(batch):
        a[i, :] = x[order[i]]
    for k in range(layers):
        w = weights[k]
        b = biases[k]
        p, d = w.shape
        a = a_buf[a_off[k] : a_off[k] + batch * d].reshape((batch, d))
        if k + 1 < layers:
            h = a_buf[a_off[k + 1] : a_off[k + 1] + batch * p].reshape((batch, p))
        else:
            h = g_buf[g_off[k] : g_off[k] + batch * p].reshape((batch, p))
        np.dot(a, w.T, h)
        hidden = k + 1 < layers
        for i in range(batch):
            for j in range(p):
                v = h[i, j] + b[j]
                if hidden and v < 0:  # ReLU (NaN passes, as torch.relu)
                    h[i, j] = 0
                else:
                    h[i, j] = v
    # the last layer's output gradient: (softmax − onehot) / (the subject's records)
    g = g_buf[g_off[layers - 1] :].reshape((batch, classes))
    for u in range(starts.shape[0] - 1):
        scale = 1.0 / (starts[u + 1] - starts[u])
        for i in range(starts[u], starts[u + 1]):
            top = g[i, 0]
            for j in range(1, classes):
                if g[i, j] > top:
                    top = g[i, j]
            total = 0.0
            for j in range(classes):
                e = np.exp(g[i, j] - top)
                g[i, j] = e
                total += e
            for j in range(classes):
                g[i, j] = g[i, j] / total
            g[i, y[order[i]]] -= 1
            for j in range(classes):
                g[i, j] *= scale
    for k in range(layers - 1, 0, -1):
        w = weights[k]
        p, d = w.shape
        gk = g_buf[g_off[k] : g_off[k] + batch * p].reshape((batch, p))
        a = a_buf[a_off[k] : a_off[k] + batch * d].reshape((batch, d))
        g = g_buf[g_off[k - 1] : g_off[k - 1] + batch * d].reshape((batch, d))
        np.dot(gk, w, g)
        for i in range(batch):
            for j in range(d):
                if a[i, j] <= 0:  # threshold_backward: 0 where the ReLU's output is <= 0
                    g[i, j] = 0
    return True


@numba.njit(cache=True, nogil=True)
def _subject_sq(a_buf, g_buf, a_off, g_off, dims, outs, bias, starts):  # type: ignore[no-untyped-def]
    subjects = starts.shape[0] - 1
    batch = starts[subjects]
    sq = np.zeros(subjects)
    mag = np.zeros(subjects)
    a_max = 0.0  # the largest ||ã_i||² of any layer
    for k in range(dims.shape[0]):
        d = dims[k]
        p = outs[k]
        one = 1.0 if bias[k] else 0.0
        a = a_buf[a_off[k] : a_off[k] + batch * d].reshape((batch, d)).astype(np.float64)
        g = g_buf[g_off[k] : g_off[k] + batch * p].reshape((batch, p)).astype(np.float64)
        na = np.empty(batch)
        ng = np.empty(batch)
        for i in range(batch):
            s = one
            for j in range(d):
                s += a[i, j] * a[i, j]
            na[i] = s
            if s > a_max or s != s:
                a_max = s
            s = 0.0
            for j in range(p):
                s += g[i, j] * g[i, j]
            ng[i] = s
        for u in range(subjects):
            lo = starts[u]
            hi = starts[u + 1]
            n = hi - lo
            m = 0.0
            for i in range(lo, hi):
                m += np.sqrt(na[i] * ng[i])
            mag[u] += m
            if n == 1:
                sq[u] += na[lo] * ng[lo]
            elif n <= GRAM_ALWAYS or n * (p + d + 1) <= p * (d + 1):
                # Gram sum Σ_{i,j} (g_i·g_j)(ã_i·ã_j)
                if n <= GRAM_ALWAYS:  # loops: cheaper than BLAS calls for so few
                    acc = 0.0
                    for i in range(lo, hi):
                        for i2 in range(lo, hi):
                            gg = 0.0
                            for j in range(p):
                                gg += g[i, j] * g[i2, j]
                            aa = one
                            for j in range(d):
                                aa += a[i, j] * a[i2, j]
                            acc += gg * aa
                else:
                    gs = g[lo:hi]
                    as_ = a[lo:hi]
                    kg = np.dot(gs, gs.T)
                    ka = np.dot(as_, as_.T)
                    acc = 0.0
                    for i in range(n):
                        for i2 in range(n):
                            acc += kg[i, i2] * (ka[i, i2] + one)
                sq[u] += acc
            else:  # the subject's gradient Σ_i g_i ãᵢᵀ, materialised
                gs = g[lo:hi]
                grad = np.dot(gs.T, a[lo:hi])
                acc = 0.0
                for j in range(p):
                    for j2 in range(d):
                        acc += grad[j, j2] * grad[j, j2]
                    if bias[k]:
                        column = 0.0
                        for i in range(n):
                            column += gs[i, j]
                        acc += column * column
                sq[u] += acc
    return sq, mag, a_max


@numba.njit(cache=True, nogil=True)
def _release(a_buf, g_buf, a_off, g_off, dims, outs, bias, starts, coef, drop, out, o_off):  # type: ignore[no-untyped-def]
    batch = starts[starts.shape[0] - 1]
    dropped = False
    for u in range(coef.shape[0]):
        if drop[u]:  # the subject is left out
            dropped = True
    for k in range(dims.shape[0]):
        d = dims[k]
        p = outs[k]
        a = a_buf[a_off[k] : a_off[k] + batch * d].reshape((batch, d))
        g = g_buf[g_off[k] : g_off[k] + batch * p].reshape((batch, p))
        if dropped:  # a copy, its rows zeroed below
            a = a.copy()
        gw = np.empty((batch, p), dtype=coef.dtype)
        for u in range(starts.shape[0] - 1):
            c = coef[u]
            for i in range(starts[u], starts[u + 1]):
                if drop[u]:  # zero rows (0·inf would be NaN)
                    for j in range(p):
                        gw[i, j] = 0
                    for j in range(d):
                        a[i, j] = 0
                else:
                    for j in range(p):
                        gw[i, j] = g[i, j] * c
        o = o_off[k]
        np.dot(gw.T, a, out[o : o + p * d].reshape((p, d)))
        if bias[k]:
            o += p * d
            for j in range(p):
                out[o + j] = 0
            for i in range(batch):
                for j in range(p):
                    out[o + j] += gw[i, j]


@dataclass
class KernelPass:
    """One pass's captured layers (records in subject order) and its per-subject sums."""

    kernel: DenseKernel
    starts: np.ndarray  # subject u's records are rows starts[u]:starts[u + 1]
    a_buf: np.ndarray
    g_buf: np.ndarray
    a_off: np.ndarray
    g_off: np.ndarray
    sq: torch.Tensor  # float64, one per subject
    mag: torch.Tensor  # float64, one per subject
    a_max: float  # the largest input norm ||ã|| of any record and layer
    largest: int  # the most records of a subject

    def check(self, coefficients: torch.Tensor) -> int:
        """The number of subjects, if ``coefficients`` has one value per subject; else a
        ValueError naming both shapes."""
        subjects = self.starts.shape[0] - 1
        if tuple(coefficients.shape) != (subjects,):
            raise ValueError(
                f"Expected one coefficient per subject, shape ({subjects},), got "
                f"{tuple(coefficients.shape)}."
            )
        return subjects

    def release(
        self, coefficients: torch.Tensor, dtype: torch.dtype, drop: torch.Tensor | None
    ) -> Params:
        """``Σ_u v_u Σ_{i∈u} g_i ãᵢᵀ`` per parameter (``coefficients`` ``v``: one per
        subject), formed in ``dtype`` (the parameters' or float64) and returned in the
        parameters' dtype; the records of subjects where ``drop`` is set are left out."""
        kernel = self.kernel
        a_buf, g_buf = self.a_buf, self.g_buf
        if dtype == torch.float64 and a_buf.dtype != np.float64:
            a_buf, g_buf = a_buf.astype(np.float64), g_buf.astype(np.float64)
        subjects = self.check(coefficients)
        coef = np.ascontiguousarray(coefficients.detach().numpy(), dtype=a_buf.dtype)
        gone = np.zeros(subjects, dtype=np.bool_) if drop is None else drop.numpy()
        out = np.empty(int(kernel.o_off[-1]), dtype=a_buf.dtype)
        with _OneBlasThread():
            _release(
                a_buf, g_buf, self.a_off, self.g_off, kernel.dims, kernel.outs, kernel.bias,
                self.starts, coef, gone, out, kernel.o_off,
            )  # fmt: skip
        if out.dtype != kernel.np_dtype:
            out = out.astype(kernel.np_dtype)
        summed: Params = {}
        for (weight, bias), start, (p, d) in kernel.layout:  # numpy views: cheaper than torch's
            summed[weight] = torch.from_numpy(out[start : start + p * d].reshape(p, d))
            if bias is not None:
                summed[bias] = torch.from_numpy(out[start + p * d : start + p * d + p])
        return summed


class DenseKernel:
    """The compiled path of a chain ``Linear (ReLU Linear)*`` (biases optional)."""

    def __init__(self, ops: list[Op], dtype: torch.dtype) -> None:
        linear = [op for op in ops if op.kind == "linear"]
        modules = [cast(nn.Linear, op.module) for op in linear]
        assert all(isinstance(m, nn.Linear) for m in modules)
        self.dtype = dtype
        dt = np.float64 if dtype == torch.float64 else np.float32
        self.np_dtype = dt
        self.names = [
            (op.prefix + "weight", None if m.bias is None else op.prefix + "bias")
            for op, m in zip(linear, modules, strict=True)
        ]
        self.dims = np.array([m.in_features for m in modules], dtype=np.int64)
        self.outs = np.array([m.out_features for m in modules], dtype=np.int64)
        self.bias = np.array([m.bias is not None for m in modules], dtype=np.bool_)
        sizes = self.outs * self.dims + self.outs * self.bias
        self.o_off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.layout = [
            (names, int(start), (int(p), int(d)))
            for names, start, p, d in zip(
                self.names, self.o_off, self.outs, self.dims, strict=False
            )
        ]
        self._zeros = [np.zeros(int(p), dtype=self.np_dtype) for p in self.outs]
        self._offsets: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.layers = len(self.names)
        #: the longest dot product of a layer (``d + p + 2``, as the torch path counts)
        self.width = int((self.dims + self.outs).max()) + 2
        #: bytes of captured inputs and output gradients per record
        self.record_bytes = int(self.dims.sum() + self.outs.sum()) * np.dtype(dt).itemsize
        #: the most records of a subject that takes the Gram route on some layer
        cheaper = self.outs * (self.dims + 1) // (self.outs + self.dims + 1)
        self.largest_gram = max(GRAM_ALWAYS, int(cheaper.max()))
        #: the most entries of one layer's weight and bias gradient
        self.largest_gradient = int((self.outs * (self.dims + 1)).max())

    @classmethod
    def build(cls, body: list[Op], dtype: torch.dtype) -> DenseKernel | None:
        """The kernel for a chain body (no flatten), or ``None`` unless it alternates
        ``Linear, ReLU, …, Linear`` in float32 or float64."""
        kinds = [op.kind for op in body]
        if dtype not in (torch.float32, torch.float64) or not kinds or len(kinds) % 2 == 0:
            return None
        if any(kind != ("linear" if i % 2 == 0 else "relu") for i, kind in enumerate(kinds)):
            return None
        return cls(body, dtype)

    def _offsets_for(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        offsets = self._offsets.get(batch)
        if offsets is None:
            if len(self._offsets) > 64:
                self._offsets = {}
            offsets = (
                np.concatenate([[0], np.cumsum(self.dims * batch)]).astype(np.int64),
                np.concatenate([[0], np.cumsum(self.outs * batch)]).astype(np.int64),
            )
            self._offsets[batch] = offsets
        return offsets

    def capture(
        self, params: Params, x: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor,
        counts: torch.Tensor,
    ) -> KernelPass | None:  # fmt: skip
        """The passes and per-subject sums of ``Σ_i CE(f(x_i), y_i)/n_{a(i)}`` for ``x``
        (rows ``(B, d_0)``), labels ``y`` in ``[0, classes)``, subjects ``inverse`` (rows
        ``0..S-1``) of ``counts`` records; ``None`` where this path does not apply
        (dtypes, shapes, labels)."""
        weights = []
        biases = []
        for (wname, bname), zeros, (_, _, shape) in zip(
            self.names, self._zeros, self.layout, strict=True
        ):
            w = params[wname]
            bias = None if bname is None else params[bname]
            if w.dtype != self.dtype or tuple(w.shape) != shape:
                return None  # the torch path raises what torch raises
            if bias is not None and (bias.dtype != self.dtype or tuple(bias.shape) != shape[:1]):
                return None
            weights.append(np.ascontiguousarray(w.detach().numpy()))
            biases.append(zeros if bias is None else np.ascontiguousarray(bias.detach().numpy()))
        batch = int(x.shape[0])
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != int(self.dims[0]) or not batch:
            return None
        if y.dtype != torch.long or y.shape != (batch,):
            return None
        order, starts, largest = _layout(inverse.numpy(), int(counts.numel()))
        a_off, g_off = self._offsets_for(batch)
        a_buf = np.empty(int(a_off[-1]), dtype=self.np_dtype)
        g_buf = np.empty(int(g_off[-1]), dtype=self.np_dtype)
        with _OneBlasThread():
            ok = _passes(
                np.ascontiguousarray(x.detach().numpy()), y.numpy(), order, starts,
                tuple(weights), tuple(biases), a_buf, g_buf, a_off, g_off,
            )  # fmt: skip
            if not ok:  # a label out of range: the torch path raises or ignores it, as torch
                return None
            sq, mag, a_max = _subject_sq(
                a_buf, g_buf, a_off, g_off, self.dims, self.outs, self.bias, starts
            )
        return KernelPass(
            self,
            starts,
            a_buf,
            g_buf,
            a_off,
            g_off,
            torch.from_numpy(sq),
            torch.from_numpy(mag),
            float(np.sqrt(a_max)),
            int(largest),
        )
