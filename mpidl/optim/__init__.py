"""Optimizers that update parameters in place (SGD, Adam, AdamW, and the layer-wise LARS
and LAMB), learning-rate schedules, gradient clipping."""
from mpidl.optim.adam import Adam, AdamW
from mpidl.optim.clip import clip_grad_norm_, grad_norm, gradient_norm
from mpidl.optim.finite import all_finite, grads_finite, params_finite
from mpidl.optim.lamb import LAMB
from mpidl.optim.lars import LARS
from mpidl.optim.layerwise import Segment, TensorNorms
from mpidl.optim.master import MasterWeights
from mpidl.optim.optimizer import Optimizer
from mpidl.optim.scaler import DynamicLossScale, unscale_
from mpidl.optim.schedule import linear_scaling_rule, warmup_cosine, warmup_linear
from mpidl.optim.sgd import SGD

__all__ = [
    "Optimizer", "MasterWeights", "SGD", "Adam", "AdamW", "LARS", "LAMB", "Segment", "TensorNorms", "clip_grad_norm_", "grad_norm", "gradient_norm",
    "all_finite", "grads_finite", "params_finite", "DynamicLossScale", "unscale_",
    "warmup_cosine", "warmup_linear", "linear_scaling_rule",
]
