"""Measuring: what runs on a GPU, how fast, how close to the card's ceilings, and what the course's stored runs say.

    kernels     `python -m gpullm_lessons.bench ...`: the kernel benchmark (every version validated, then timed, beside
                PyTorch) and the measured ceilings; the command line of every benchmark
    train_step  the training step's benchmarks: ours beside PyTorch eager and torch.compile, memory, long context, GPU
                time per op
    inductor    what torch.compile does to the same GPT: what it keeps for the backward, the kernels it runs
    timing      how the course times: validate first (validate_then_time), then the clocks: CUDA events, CUDA
                graphs, the host's time per call; the copy and matmul ceilings
    profiling   Nsight Compute and CUPTI: counters, stalls, timelines
    stored      the stored runs in gpullm_lessons/results/ (card and date inside), for machines without a GPU
    gpu_suite   `make gpu-test`: the whole GPU suite in parallel processes over one GPU, and its summary
    sanitize    `make sanitize`: the GPU kernel tests under compute-sanitizer, in parts
"""
