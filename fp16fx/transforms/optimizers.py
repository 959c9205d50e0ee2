"""The optimizers users call, as compositions of primitives, with torch.optim's defaults.

Each matches its torch.optim namesake's math (to float32 rounding); structural options
(momentum on or off, nesterov, amsgrad) are fixed here, numeric ones live in the state as
tensors and can be changed between steps with :func:`fp16fx.set_hyperparams`.
"""

from __future__ import annotations

from fp16fx.transforms.base import GradientTransformation, chain, check_hyperparam
from fp16fx.transforms.primitives import (
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)


def sgd(
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> GradientTransformation:
    """Returns ``torch.optim.SGD``'s update: L2 decay, optional (Nesterov) momentum, ``-lr``.

    For a gradient ``g`` of param ``p``, with a buffer ``b`` (set to ``g`` at the first step)::

        g <- g + weight_decay * p
        b <- momentum * b + (1 - dampening) * g
        p <- p - lr * (g + momentum * b if nesterov else b)      (with momentum)
        p <- p - lr * g                                           (without)

    Args:
      lr: the learning rate.
      momentum: the momentum factor. Momentum is built in when ``momentum > 0`` or
        ``nesterov``; a momentum of 0 given here cannot be raised later (there would be no
        buffer).
      dampening: the damping of the gradient entering the buffer.
      weight_decay: the L2 penalty's factor, added to the gradient.
      nesterov: Nesterov momentum.
    """
    check_hyperparam("momentum", momentum)
    parts = [add_decayed_weights(weight_decay)]
    if momentum > 0 or nesterov:
        parts.append(trace(momentum, dampening, nesterov))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)


def adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Returns ``torch.optim.Adam``'s update: L2 decay added to the gradient, then Adam.

    At step ``t`` (from 1), for a gradient ``g`` of param ``p`` (Kingma & Ba, 2015)::

        g <- g + weight_decay * p
        m <- b1 * m + (1 - b1) * g
        v <- b2 * v + (1 - b2) * g**2              (amsgrad: v_max <- max(v_max, v), used for v)
        p <- p - lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)

    Args:
      lr: the learning rate.
      betas: ``(b1, b2)``, the decay rates of the first and second moments.
      eps: added to the denominator.
      weight_decay: the L2 penalty's factor, added to the gradient.
      amsgrad: divide by the largest second moment so far (Reddi et al., 2018).
    """
    return chain(
        add_decayed_weights(weight_decay),
        scale_by_adam(betas, eps, amsgrad),
        scale_by_learning_rate(lr),
    )


def adamw(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Returns ``torch.optim.AdamW``'s update: Adam, then decoupled decay, times ``-lr``.

    ``p <- p - lr * (adam(g) + weight_decay * p)`` (Loshchilov & Hutter, 2019), where
    ``adam(g)`` is :func:`adam`'s bias-corrected ``m / (sqrt(v) + eps)`` of the plain
    gradient. The arguments are :func:`adam`'s; ``weight_decay`` is the decoupled decay's.
    """
    return chain(
        scale_by_adam(betas, eps, amsgrad),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )
