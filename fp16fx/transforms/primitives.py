"""The primitive transforms the named optimizers are built from.

Each states its rule on the incoming update ``u`` of one leaf with FP32 master ``p``; scalar
coefficients are computed in float64 and the elementwise math runs in float32, as in
torch.optim's single-tensor implementations.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp16fx.transforms.base import (
    GradientTransformation,
    check_hyperparam,
    hyperparams,
    scalars,
    stateless,
)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Returns the transform ``u <- u + weight_decay * p`` (L2 / decoupled weight decay)."""

    def update(updates, params, hp, grad_norm):
        wd = hp["weight_decay"].float()
        return [u + wd * p for u, p in zip(updates, params)]

    return stateless(update, weight_decay=weight_decay)


def scale_by_learning_rate(lr: float) -> GradientTransformation:
    """Returns the transform ``u <- -lr * u`` (the sign makes it a descent step)."""

    def update(updates, params, hp, grad_norm):
        neg_lr = (-hp["lr"]).float()
        return [neg_lr * u for u in updates]

    return stateless(update, lr=lr)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Returns the transform ``u <- u * min(1, max_norm / (‖u‖ + 1e-6))``, ‖·‖ over all leaves.

    The same rule and epsilon as ``torch.nn.utils.clip_grad_norm_``. As the first transform of
    a step it reuses the norm the step already computed (no extra pass over memory); elsewhere
    in a chain it computes the norm of its own input.
    """

    def update(updates, params, hp, grad_norm):
        if grad_norm is None:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(u) for u in updates])
            )
        (coef,) = scalars(torch.clamp(hp["max_norm"] / (grad_norm.double() + 1e-6), max=1.0))
        return [u * coef for u in updates]

    return stateless(update, max_norm=max_norm)


class TraceState(NamedTuple):
    """Per-leaf state of :func:`trace`: applied steps and the momentum buffer."""

    count: torch.Tensor
    momentum_buffer: torch.Tensor


def trace(
    momentum: float, dampening: float = 0.0, nesterov: bool = False
) -> GradientTransformation:
    """Returns SGD's momentum transform, as ``torch.optim.SGD`` applies it.

    ``b <- u`` on a leaf's first step, else ``b <- momentum * b + (1 - dampening) * u``;
    then ``u <- u + momentum * b`` with Nesterov, else ``u <- b``.
    """
    check_hyperparam("momentum", momentum)
    check_hyperparam("dampening", dampening)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")

    def init_leaf(param: torch.Tensor, index: int) -> TraceState:
        return TraceState(
            count=torch.zeros((), dtype=torch.int64, device=param.device),
            momentum_buffer=torch.zeros_like(param, dtype=torch.float32),
        )

    def update(updates, leaf_states, params, hp, grad_norm, indices):
        mom = hp["momentum"].float()
        keep = (1 - hp["dampening"]).float()
        new_updates, new_states = [], []
        for u, state in zip(updates, leaf_states):
            buf = torch.where(state.count == 0, u, mom * state.momentum_buffer + keep * u)
            new_updates.append(u + mom * buf if nesterov else buf)
            new_states.append(TraceState(state.count + 1, buf))
        return new_updates, new_states

    return GradientTransformation(
        init_hyperparams=lambda device: hyperparams(device, momentum=momentum, dampening=dampening),
        init_leaf=init_leaf,
        update=update,
    )


class ScaleByAdamState(NamedTuple):
    """Per-leaf state of :func:`scale_by_adam`: steps, first and second moments, and the
    running maximum of the second moment (AMSGrad; an empty tensor otherwise)."""

    count: torch.Tensor
    mu: torch.Tensor
    nu: torch.Tensor
    nu_max: torch.Tensor


def scale_by_adam(
    beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, amsgrad: bool = False
) -> GradientTransformation:
    """Returns Adam's preconditioning, with torch.optim.Adam's bias-correction placement.

    With ``t`` the leaf's step count after this step::

        m <- beta1 * m + (1 - beta1) * u
        v <- beta2 * v + (1 - beta2) * u * u
        v_hat <- max(v_max, v) if amsgrad else v
        u <- m / (1 - beta1**t) / (sqrt(v_hat) / sqrt(1 - beta2**t) + eps)

    (Kingma & Ba, 2015; AMSGrad: Reddi et al., 2018.) ``eps`` is added after the bias
    correction of ``sqrt(v)``, as torch does, not inside the square root.
    """
    for name, value in (("beta1", beta1), ("beta2", beta2), ("eps", eps)):
        check_hyperparam(name, value)

    def init_leaf(param: torch.Tensor, index: int) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=torch.zeros((), dtype=torch.int64, device=param.device),
            mu=torch.zeros_like(param, dtype=torch.float32),
            nu=torch.zeros_like(param, dtype=torch.float32),
            nu_max=torch.zeros_like(param, dtype=torch.float32)
            if amsgrad
            else param.new_empty(0, dtype=torch.float32),
        )

    def update(updates, leaf_states, params, hp, grad_norm, indices):
        b1, b2 = hp["beta1"], hp["beta2"]
        new_updates, new_states = [], []
        for u, state in zip(updates, leaf_states):
            count = state.count + 1
            # Reciprocals turn two of three divisions per element into multiplications.
            decay1, weight1, decay2, weight2, inv_correction1, inv_correction2_sqrt, eps = scalars(
                b1,
                1 - b1,
                b2,
                1 - b2,
                1 / (1 - b1**count),
                torch.rsqrt(1 - b2**count),
                hp["eps"],
            )
            mu = state.mu * decay1 + weight1 * u  # no blend of lerp's two formulas
            nu = state.nu * decay2 + weight2 * u * u
            nu_max = torch.maximum(state.nu_max, nu) if amsgrad else state.nu_max
            denom = torch.sqrt(nu_max if amsgrad else nu) * inv_correction2_sqrt + eps
            new_updates.append(mu * inv_correction1 / denom)
            new_states.append(ScaleByAdamState(count, mu, nu, nu_max))
        return new_updates, new_states

    return GradientTransformation(
        init_hyperparams=lambda device: hyperparams(device, beta1=beta1, beta2=beta2, eps=eps),
        init_leaf=init_leaf,
        update=update,
    )
