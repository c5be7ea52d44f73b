"""Lesson 05, GELU, attention and cross-entropy backward: the causal mask's skipped work, the fused
cross-entropy's two passes over a row."""

from __future__ import annotations

from .common import pyplot


def plot_attention_backward_mask(T: int = 8, t: int = 5, s: int = 2, ax=None):
    """Causal attention backward on one head's (T, T) matrices: which entries the kernels compute and which the
    mask lets them skip (att = 0 above the diagonal), and which entries feed dq[t] (row t) and dk[s], dv[s]
    (column s). Rows are query positions t, columns key positions s."""
    import numpy as np

    plt = pyplot()
    if ax is None:
        fig, axes = plt.subplots(1, 3, figsize=(13, 5.2))
    else:
        axes, fig = ax, ax[0].figure
    lower = np.tril(np.ones((T, T), dtype=bool))
    panels = [
        ("datt = dy v^T, dpre = softmax bwd:\ncomputed for s <= t, skipped above", lower, "tab:blue"),
        (
            f"dq[t={t}] = scale * sum over s <= {t} of\ndpre[{t}, s] k[s]   (row t)",
            lower & (np.arange(T)[:, None] == t),
            "tab:orange",
        ),
        (
            f"dk[{s}] = scale * sum over t >= {s} of dpre[t, {s}] q[t]\n"
            f"dv[{s}] = sum over t >= {s} of att[t, {s}] dy[t]  (column s)",
            lower & (np.arange(T)[None, :] == s),
            "tab:green",
        ),
    ]
    for a, (title, used, color) in zip(axes, panels):
        for i in range(T):
            for j in range(T):
                if j > i:  # masked: att = 0, never computed, never read
                    a.add_patch(plt.Rectangle((j, i), 1, 1, facecolor="0.93", edgecolor="0.75", hatch="//", lw=0.5))
                else:
                    a.add_patch(
                        plt.Rectangle(
                            (j, i),
                            1,
                            1,
                            facecolor=color if used[i, j] else "white",
                            alpha=0.75 if used[i, j] else 1.0,
                            edgecolor="0.6",
                            lw=0.5,
                        )
                    )
        a.set_xlim(0, T)
        a.set_ylim(T, 0)
        a.set_aspect("equal")
        a.set_xticks(np.arange(T) + 0.5, [str(k) for k in range(T)], fontsize=7)
        a.set_yticks(np.arange(T) + 0.5, [str(k) for k in range(T)], fontsize=7)
        a.set_xlabel("key position s")
        a.set_ylabel("query position t")
        a.set_title(title, fontsize=9)
    n_skip = T * (T - 1) // 2
    fig.suptitle(
        f"one head, T = {T}: {T * (T + 1) // 2} of {T * T} entries computed; the hatched {n_skip} "
        f"(s > t, att = 0) are skipped: {100 * n_skip / (T * T):.0f}% of the (T, T) work "
        f"(-> 50% as T grows)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.9))
    return fig


def plot_crossentropy_row_pass(V: int = 16, threads: int = 4, target: int = 6, N: int = 8, seed: int = 0, ax=None):
    """The fused cross-entropy backward on one row of logits, one block of `threads` threads per row:
    pass 1, thread k folds logits k, k + threads, ... into a running (max m, sum s) pair (online softmax);
    the block merges the pairs (a tree); pass 2 reads the row again and writes
    dlogits_j = (exp(x_j - m) / s - [j == target]) / N directly: the (N, V) probabilities are never stored."""
    import numpy as np

    plt = pyplot()
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal(V) * 1.5, 1).astype(np.float32)
    pairs = []
    for k in range(threads):  # pass 1: online softmax per thread slice
        m, s = -np.inf, 0.0
        for v in x[k::threads]:
            if v > m:
                s, m = s * np.exp(m - v) + 1.0, v
            else:
                s += np.exp(v - m)
        pairs.append((float(m), float(s)))
    m_row = max(p[0] for p in pairs)
    s_row = sum(p[1] * np.exp(p[0] - m_row) for p in pairs)  # merge
    d = (np.exp(x - m_row) / s_row - (np.arange(V) == target)) / N
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(1.0 + 0.75 * V, 16), 5.2))
    else:
        fig = ax.figure
    colors = plt.get_cmap("tab10")
    y_in, y_pair, y_row, y_out = 4.2, 2.8, 1.6, 0.0
    for j in range(V):  # the row of logits, coloured by owner thread
        ax.add_patch(plt.Rectangle((j, y_in), 0.95, 0.8, color=colors(j % threads), alpha=0.55))
        ax.text(j + 0.47, y_in + 0.4, f"{x[j]:.1f}", ha="center", va="center", fontsize=7)
        ax.text(j + 0.47, y_in + 0.95, str(j), ha="center", va="bottom", fontsize=6, color="0.4")
    ax.text(-0.3, y_in + 0.4, "logits[row, :]\n(read, pass 1)", ha="right", va="center", fontsize=8)
    w = V / threads
    for k, (m, s) in enumerate(pairs):  # one (m, s) pair per thread
        x0 = k * w + 0.1 * w
        ax.add_patch(plt.Rectangle((x0, y_pair), 0.8 * w, 0.8, color=colors(k), alpha=0.3))
        ax.text(x0 + 0.4 * w, y_pair + 0.4, f"thread {k}\nm={m:.1f}  s={s:.2f}", ha="center", va="center", fontsize=7)
        for j in range(k, V, threads):
            ax.plot([j + 0.47, x0 + 0.4 * w], [y_in, y_pair + 0.8], color=colors(k), lw=0.5, alpha=0.5)
        ax.plot([x0 + 0.4 * w, V / 2], [y_pair, y_row + 0.8], color="0.4", lw=0.8)
    ax.text(-0.3, y_pair + 0.4, "online softmax\nper thread", ha="right", va="center", fontsize=8)
    ax.add_patch(plt.Rectangle((V / 2 - 2.5, y_row), 5, 0.8, color="0.85"))
    ax.text(V / 2, y_row + 0.4, f"block merge: m = {m_row:.1f}, s = {s_row:.2f}", ha="center", va="center", fontsize=8)
    ax.text(
        -0.3, y_row + 0.4, f"merge pairs\n(tree: {int(np.log2(threads))} steps)", ha="right", va="center", fontsize=8
    )
    vmax = float(np.abs(d).max())
    cmap = plt.get_cmap("coolwarm")
    for j in range(V):  # pass 2: dlogits written directly
        ax.add_patch(
            plt.Rectangle(
                (j, y_out),
                0.95,
                0.8,
                color=cmap(0.5 + 0.5 * d[j] / vmax),
                ec="red" if j == target else None,
                lw=2 if j == target else 0,
            )
        )
        ax.text(j + 0.47, y_out + 0.4, f"{d[j] * 1000:.0f}", ha="center", va="center", fontsize=7)
        ax.plot([j + 0.47, j + 0.47], [y_out + 0.8, y_out + 1.25], color=colors(j % threads), lw=0.6)
    ax.text(-0.3, y_out + 1.05, "owner thread", ha="right", va="center", fontsize=7, color="0.4")
    ax.text(-0.3, y_out + 0.4, "dlogits[row, :] x 1000\n(written, pass 2)", ha="right", va="center", fontsize=8)
    ax.text(target + 0.47, y_out - 0.25, "target", ha="center", va="top", fontsize=7, color="red")
    ax.set_xlim(-3.2, V + 0.2)
    ax.set_ylim(-0.7, y_in + 1.4)
    ax.axis("off")
    ax.set_title(
        f"one row, V = {V}, one block of {threads} threads (thread k owns logits k, k + {threads}, ...): "
        f"dlogits_j = (exp(x_j - m) / s - [j = target]) / N, N = {N}\n"
        f"pass 2 re-reads the logits; the probabilities never get their own (N, V) array",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
