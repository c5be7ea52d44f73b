"""The model's parameters and the NumPy math around its step, which the engines and the checkers share.

    params         GPTConfig, the presets, the flat parameter buffer and its layout
    optim          AdamW and the learning-rate schedule on the flat buffer (the reference update)
    precision      mixed precision: bfloat16 bits, dynamic loss scaling, a skipped or taken step
    quant          block-wise 8-bit quantisation of AdamW's moments
    checkpointing  activation checkpointing: which activations a policy keeps and what it recomputes
"""
