"""The checkers: a learner's function run on fresh random inputs against the reference, and one verdict that says
what is wrong and where.

The core, used by every checker module:
    verdict       CheckResult, recording a verdict, calling the learner's function, the shared error and number formats
    opcheck       how an op checker runs: cases, poisoned and guarded outputs, the comparison, the hints (opcheck.run)
    borrowed      a graded answer that is, wraps or calls the course's own implementation of its task is wrong
    kernel_trace  a Numba kernel run once in the simulator with every memory access recorded (hints, viz.show_kernel)
    gradcheck     a backward pass against central finite differences in float64 (lesson 01)

The checkers, one module per topic:
    backward      the ops' backward passes (lessons 01-05): linear, softmax, layernorm, gelu, cross-entropy, ...
    ops           the op tasks of lessons 04-05 (LayerNorm's parameter gradients, the online cross-entropy, ...)
    kernels       kernel-level tasks (tiled products, warp reductions, the bias add)
    optim         AdamW (lessons 06, 07)
    precision     bf16 rounding, loss scaling (lesson 07)
    memory        activation checkpointing (lesson 08)
    train         the training loop's pieces (lesson 09)
    capstone      the capstone engine (lesson 09)
    parallel      the ring all-reduce, shards and buckets (lesson 10)
    flash         flash attention (lesson 11)
    scale         gradient accumulation, 8-bit moments, bucket assignment (lesson 12)
    beyond        a column-parallel backward, the ring-attention merge, the 1F1B table (lesson 13)
    epilogue      a tiled product with its forward or backward epilogue fused in (lesson 14)
"""
