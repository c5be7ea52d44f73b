"""Input validation shared by the reference ops: clear errors that name the op, the argument and the problem."""
import numpy as np


def _float_array(fn, name, x):
    """x as an array; TypeError naming `fn` and `name` unless it is floating point."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{fn}: {name} must be a floating-point array, got dtype {x.dtype}")
    return x


def _dout_shaped(fn, dout, name, shape):
    """dout as an array; ValueError naming `fn` unless it has `shape`, the shape `name` had in the forward."""
    dout = np.asarray(dout)
    if dout.shape != shape:
        raise ValueError(f"{fn}: dout is {dout.shape} but {name} was {shape}")
    return dout
