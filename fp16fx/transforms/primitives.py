"""The primitive transforms the named optimizers are built from.

Each states its rule on the incoming update ``u`` of a param with FP32 master ``p``; scalar
coefficients are computed in float64 and the elementwise math runs in float32, as in
torch.optim's single-tensor implementations (where torch's CPU kernels fuse a multiply-add,
``p.add_(u, alpha=-lr)``, the result can land one float32 unit apart). Per-param state is a
tree like the params, one entry per segment: a step count per segment (0-d) and moments per
element.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import optree
import torch

from fp16fx.transforms.base import (
    GradientTransformation,
    GradNorm,
    Hyperparams,
    Params,
    Updates,
    check_hyperparam,
    hyperparams,
    scalars,
    stateless,
)

_map = optree.tree_map


def _counts(params: Params) -> Params:
    return _map(lambda p: torch.zeros((), dtype=torch.int64, device=p.device), params)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Returns the transform ``u <- u + weight_decay * p`` (L2 / decoupled weight decay)."""

    def update(updates: Updates, hp: Hyperparams, params: Params) -> Updates:
        wd = hp["weight_decay"].float()
        return _map(lambda u, p: u + wd * p, updates, params)

    return stateless(update, weight_decay=weight_decay)


def scale_by_learning_rate(lr: float) -> GradientTransformation:
    """Returns the transform ``u <- -lr * u`` (the sign makes it a descent step)."""

    def update(updates: Updates, hp: Hyperparams, params: Params) -> Updates:
        neg_lr = (-hp["lr"]).float()
        return _map(lambda u: neg_lr * u, updates)

    return stateless(update, lr=lr)


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: ``max_norm``, and the step's gradient norm."""

    hyperparams: Hyperparams
    grad_norm: GradNorm


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Returns the transform ``u <- u * min(1, max_norm / (‖g‖ + 1e-6))``.

    ``‖g‖`` is the global L2 norm of the step's unscaled gradients, over all params (and all
    ranks of a sharded state), which the step computes anyway to check them and hands over in
    :class:`GradNorm`: the rule and epsilon of ``torch.nn.utils.clip_grad_norm_`` called
    before ``optimizer.step()``. Put it first in a chain: later, it still clips by the
    gradients' norm, not by the norm of what it is given.
    """
    check_hyperparam("max_norm", max_norm)

    def init(params: Params) -> ClipByGlobalNormState:
        hp = hyperparams(params, max_norm=max_norm)
        return ClipByGlobalNormState(hp, GradNorm(torch.zeros((), device=hp["max_norm"].device)))

    def update(
        updates: Updates, state: ClipByGlobalNormState, params: Params
    ) -> tuple[Updates, ClipByGlobalNormState]:
        (coef,) = scalars(clip_coefficient(state.hyperparams["max_norm"], state.grad_norm.value))
        return _map(lambda u: u * coef, updates), state

    return GradientTransformation(init, update)


#: FP32's smallest normal: Adam's least ``eps``, so that its denominator is never 0.
_TINY = torch.finfo(torch.float32).tiny

#: The ``1e-6`` of ``torch.nn.utils.clip_grad_norm_``'s rule, which keeps a zero norm finite.
CLIP_EPS = 1e-6


#: A ``max_norm`` that clips nothing: its :func:`clip_coefficient` is 1 whatever the norm,
#: also where the norm overflowed to inf (finite grads past 1.8e19), where the rule gives 0.
#: (``FP16_Optimizer`` keeps ``clip_by_global_norm(NO_CLIP)`` in its chain, so that a clip
#: asked for later changes a hyperparameter, not the compiled step.)
NO_CLIP = sys.float_info.max


def clip_coefficient(
    max_norm: float | torch.Tensor, norm: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Returns ``min(1, max_norm / (norm + 1e-6))`` as a 0-d tensor of ``dtype`` (1 for
    :data:`NO_CLIP`): the factor :func:`clip_by_global_norm` scales updates by when the
    gradients' global norm is ``norm`` (``torch.nn.utils.clip_grad_norm_``'s rule; that
    function computes it in the norm's FP32, :func:`clip_by_global_norm` in float64)."""
    coefficient = torch.clamp(max_norm / (norm.to(dtype) + CLIP_EPS), max=1.0)
    no_clip = torch.as_tensor(max_norm, dtype=torch.float64) == NO_CLIP  # FP32 would say inf
    return torch.where(no_clip, 1.0, coefficient)


def clip_limit(coefficient: torch.Tensor, norm: torch.Tensor) -> float:
    """Returns the ``max_norm`` whose :func:`clip_coefficient` at ``norm`` is
    ``coefficient`` (< 1): the rule solved for it (two clips in a row as one)."""
    return float(coefficient * (norm.double() + CLIP_EPS))


class TraceState(NamedTuple):
    """State of :func:`trace`: ``momentum``/``dampening``, and per param its applied steps
    and momentum buffer."""

    hyperparams: Hyperparams
    count: Params
    momentum_buffer: Params


def trace(
    momentum: float, dampening: float = 0.0, nesterov: bool = False
) -> GradientTransformation:
    """Returns SGD's momentum transform, as ``torch.optim.SGD`` applies it.

    ``b <- u`` on a param's first step, else ``b <- momentum * b + (1 - dampening) * u``;
    then ``u <- u + momentum * b`` with Nesterov, else ``u <- b``. A momentum set to 0 later
    (``set_hyperparams``) leaves ``u`` and the buffer as they are, and its steps are no
    param's first: torch.optim.SGD's ``momentum == 0`` branch, which keeps no buffer.
    Nesterov with a dampening is refused here, as torch.optim.SGD refuses it when built; a
    dampening set later is stepped by the formulas above, as torch steps it.
    """
    check_hyperparam("momentum", momentum)
    check_hyperparam("dampening", dampening)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")

    def init(params: Params) -> TraceState:
        return TraceState(
            hyperparams=hyperparams(params, momentum=momentum, dampening=dampening),
            count=_counts(params),
            momentum_buffer=_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params),
        )

    def update(updates: Updates, state: TraceState, params: Params) -> tuple[Updates, TraceState]:
        on = state.hyperparams["momentum"] != 0  # before the cast: 1e-300 is on, as in torch
        mom = state.hyperparams["momentum"].float()
        keep = (1 - state.hyperparams["dampening"]).float()
        buffers = _map(
            lambda u, count, b: torch.where(on, torch.where(count == 0, u, mom * b + keep * u), b),
            updates,
            state.count,
            state.momentum_buffer,
        )
        if nesterov:
            new_updates = _map(lambda u, b: u + mom * b, updates, buffers)
        else:
            new_updates = _map(lambda u, b: torch.where(on, b, u), updates, buffers)
        counts = _map(lambda count: torch.where(on, count + 1, count), state.count)
        return new_updates, state._replace(count=counts, momentum_buffer=buffers)

    return GradientTransformation(init, update)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: ``betas``/``eps``, and per param its steps, first and
    second moments, and (AMSGrad only, else None) the running maximum of the second moment."""

    hyperparams: Hyperparams
    count: Params
    mu: Params
    nu: Params
    nu_max: Params | None

    #: The fields that are never negative, averages of squares (see transforms.base).
    non_negative = ("nu", "nu_max")


def scale_by_adam(
    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, amsgrad: bool = False
) -> GradientTransformation:
    """Returns Adam's preconditioning, with torch.optim.Adam's bias-correction placement.

    With ``t`` the param's step count after this step and ``betas = (b1, b2)``::

        m <- b1 * m + (1 - b1) * u
        v <- b2 * v + (1 - b2) * u * u
        v_hat <- max(v_max, v) if amsgrad else v
        u <- m / (1 - b1**t) / (sqrt(v_hat) / sqrt(1 - b2**t) + eps)

    (Kingma & Ba, 2015; AMSGrad: Reddi et al., 2018.) ``eps`` is added after the bias
    correction of ``sqrt(v)``, as torch does, not inside the square root. An ``eps`` below
    FP32's smallest normal, 2**-126, counts as it, so the denominator is never 0. That
    changes nothing where ``v > 0``: ``sqrt(v)`` is at least 2**-75, and adding either
    rounds away alike. Where ``v`` is 0 at ``eps = 0``, torch divides by 0: for a value given
    only zero gradients so far (and the padding of int8 moments' blocks, whose NaN a block's
    scale would spread), ``m`` is 0 too, and the update 0 where torch's is NaN; for
    gradients so small that ``(1 - b2) * u * u`` underflows FP32 (below about 1e-21 at
    b2 = 0.999), ``m / 2**-126``, huge but finite, where torch's is inf.
    """
    check_hyperparam("betas", betas)
    check_hyperparam("eps", eps)

    def zeros(params: Params) -> Params:
        return _map(lambda p: torch.zeros_like(p, dtype=torch.float32), params)

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(
            hyperparams=hyperparams(params, betas=betas, eps=eps),
            count=_counts(params),
            mu=zeros(params),
            nu=zeros(params),
            nu_max=zeros(params) if amsgrad else None,
        )

    def update(
        updates: Updates, state: ScaleByAdamState, params: Params
    ) -> tuple[Updates, ScaleByAdamState]:
        b1, b2 = state.hyperparams["betas"].unbind()
        u_leaves, treedef = optree.tree_flatten(updates)
        counts = [c + 1 for c in treedef.flatten_up_to(state.count)]
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        maxes = treedef.flatten_up_to(state.nu_max) if amsgrad else [None] * len(u_leaves)
        out_u, out_mu, out_nu, out_max = [], [], [], []
        for u, mu, nu, nu_max, count in zip(u_leaves, mus, nus, maxes, counts):
            # Reciprocals turn two of three divisions per element into multiplications.
            decay1, weight1, decay2, weight2, inv_correction1, inv_correction2_sqrt, eps = scalars(
                b1,
                1 - b1,
                b2,
                1 - b2,
                1 / (1 - b1**count),
                torch.rsqrt(1 - b2**count),
                torch.clamp(state.hyperparams["eps"], min=_TINY),
            )
            mu = mu * decay1 + weight1 * u  # no blend of lerp's two formulas
            nu = nu * decay2 + weight2 * u * u
            if amsgrad:
                nu_max = torch.maximum(nu_max, nu)
            denom = torch.sqrt(nu_max if amsgrad else nu) * inv_correction2_sqrt + eps
            out_u.append(mu * inv_correction1 / denom)
            out_mu.append(mu)
            out_nu.append(nu)
            out_max.append(nu_max)
        return treedef.unflatten(out_u), ScaleByAdamState(
            hyperparams=state.hyperparams,
            count=treedef.unflatten(counts),
            mu=treedef.unflatten(out_mu),
            nu=treedef.unflatten(out_nu),
            nu_max=treedef.unflatten(out_max) if amsgrad else None,
        )

    return GradientTransformation(init, update)
