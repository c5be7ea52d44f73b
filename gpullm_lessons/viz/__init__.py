"""Plots and drawings for the course, one module per lesson: `viz/lNN_<name>.py` holds the figures that
`notebooks/NN_<name>.ipynb` introduces (the same NN and name), so lesson 04's are in `viz/l04_layernorm_backward.py`.
A figure a later lesson reuses stays with the lesson that first draws it: plot_grid_mapping (lessons 00, 05, 06) in
l00, plot_roofline (02-05) in l02, plot_version_fractions (03, 05, 06) in l03, plot_loss (09, 10, train.py) in l09.
Lesson 01 draws nothing. `viz/common.py` holds what the modules share (pyplot(): matplotlib's pyplot, headless-safe;
figure_and_axes(): the caller's axes or a new figure's).

Import from here, not from a lesson module: `from gpullm_lessons import viz; viz.plot_loss(...)` or
`from gpullm_lessons.viz import plot_loss`. Every figure module imports only matplotlib and numpy at module level;
the course's own modules (profiling, parallel, optim, precision, checks, kernel_trace) are imported inside the
function that needs them, so importing viz pulls in no engine, job or device.
"""

from .common import figure_and_axes, pyplot  # noqa: F401  (kernel_trace's pictures draw with pyplot)
from .l00_gpu_orientation import plot_ceilings, plot_grid_mapping, show_kernel  # noqa: F401
from .l02_linear_backward import plot_dbias_columns, plot_linear_rates, plot_roofline, plot_tiled_gemm  # noqa: F401
from .l03_softmax_backward import plot_block_reduction, plot_softmax_mapping, plot_version_fractions  # noqa: F401
from .l04_layernorm_backward import plot_column_reduction, plot_layernorm_dinp_mapping  # noqa: F401
from .l05_gelu_attention_cross_entropy import plot_attention_backward_mask, plot_crossentropy_row_pass  # noqa: F401
from .l06_fused_adamw import ADAMW_TRAFFIC, plot_adamw_bytes, plot_param_buffer  # noqa: F401
from .l07_mixed_precision import (
    float_formats_html,
    float_formats_widget,
    plot_float_formats,  # noqa: F401
    plot_grad_histogram,
    plot_loss_scale,
    plot_precision_losses,
)
from .l08_activation_checkpointing import (  # noqa: F401
    plot_activation_timeline,
    plot_checkpoint_tradeoff,
    plot_segment_peaks,
)
from .l09_full_training_loop import (
    LiveLossPlot,
    plot_loss,
    plot_step_profile,
    plot_step_timeline,  # noqa: F401
    plot_train_bench,
    plot_training_step,
)
from .l10_multi_gpu import (
    _cells,
    plot_allreduce_bandwidth,
    plot_collectives,
    plot_ring_steps,  # noqa: F401
    plot_zero_memory,
)
from .l11_flash_attention import (  # noqa: F401
    attention_traffic,
    causal_tiles,
    format_attention_traffic,
    format_register_tile_layout,
    merge_halves,
    plot_causal_tiles,
    register_tile_layout,
)

from .l12_memory import format_memory_terms, plot_loss_curves  # noqa: F401
from .l13_beyond_one_gpu import STRATEGY_STYLE, plot_alpha_beta, plot_state_per_rank  # noqa: F401

_pyplot = pyplot  # its name before viz was a package
