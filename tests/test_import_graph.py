"""No import circles: the graph of every import of gpullm_lessons/ and kernels/ (module level and inside functions,
as tests/test_layers.py walks them) has no cycle, so each module can be read, tested and replaced from the bottom up.
A cycle fails with its modules and the lines that close it."""

from test_layers import _files, _imports, _is_module, _module_name, _ours


def import_graph(files):
    """{module: {module it imports: first line}} over our own modules (a name inside a module maps to the module)."""
    graph = {}
    for f in files:
        name = _module_name(f)
        for line, mod in _imports(f):
            if not _ours(mod) or mod == "gpullm_lessons":
                continue
            while not _is_module(mod) and "." in mod:
                mod = mod.rsplit(".", 1)[0]
            if mod != name:
                graph.setdefault(name, {}).setdefault(mod, f"{f.name}:{line}")
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = import_graph(_files("gpullm_lessons", "kernels"))
    found = cycles(graph)
    lines = [
        " <-> ".join(c) + ": " + ", ".join(f"{a} -> {b} ({graph[a][b]})" for a in c for b in graph.get(a, {}) if b in c)
        for c in found
    ]
    assert not found, "import circles:\n" + "\n".join(lines)


def test_a_planted_circle_is_found():
    assert cycles({"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {"a": "c.py:3"}, "d": {"a": "d.py:1"}}) == [
        ["a", "b", "c"]
    ]
    assert cycles({"a": {"b": "a.py:1"}, "b": {}}) == []
