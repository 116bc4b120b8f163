"""Cutting a model's graph into stages: which nodes each stage runs, and what crosses between them.

Plain data, tested in one process without MPI or Keras. A model is a
:class:`Graph`: numbered tensors, and nodes in a topological order, each
reading and writing some of those tensors. A chain of layers is the graph
whose node ``i`` reads what node ``i - 1`` wrote. A cut gives each stage a
contiguous run of the nodes; every tensor a later stage needs then
*crosses* from the stage that computes it (stage 0 for a model input, which
only the first stage reads from the data) to each stage that reads it (the
last stage for a model output: it computes the loss)::

    # A skip edge over two stages, and a model input read by every stage:
    #
    #   nodes:  embed -> block_0 -> block_1 -> block_2 -> head
    #                `------------------------'   (skip)
    #   mask:   (model input) -> block_0, block_1, block_2
    #
    #   stages [2, 2, 1]: stage 0: embed block_0 | stage 1: block_1 block_2 | stage 2: head
    #   crossings: block_0 -> 1; embed (skip) -> 1; mask -> 1; block_2 -> 2

Each crossing is one message per micro-batch from its source to each of its
destinations, sent directly (not relayed through the stages between); the
gradient of a floating-point tensor a stage computed comes back from every
destination and is summed there. Model inputs get no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from keras_pipe.errors import PipelineConfigError

MODEL_INPUT = -1  # the "producer" of a model input


@dataclass(frozen=True)
class Tensor:
    """A tensor of the graph: what every rank knows of it without computing it.

    ``shape`` has ``None`` for the batch and any dimension that varies from
    batch to batch; ``mask`` is the shape of the Keras mask that rides with
    it, or ``None``.
    """

    name: str
    shape: tuple
    dtype: str
    mask: tuple | None = None

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    @property
    def dynamic(self) -> bool:
        """Whether a dimension other than the batch varies (its shape travels with it)."""
        return any(d is None for d in self.shape[1:]) or (self.mask is not None and None in self.mask[1:])


@dataclass(frozen=True)
class Node:
    """One call of a layer or op: reads ``inputs``, writes ``outputs`` (tensor numbers, in call order).

    ``unit`` names the weights the call uses (a layer called at several
    nodes shares one unit); ``None`` for a call without weights. ``cost``
    weighs the node when stages are balanced (its parameters, plus one).
    """

    name: str
    inputs: tuple
    outputs: tuple
    unit: str | None = None
    cost: float = 1.0
    kind: str = ""  # the layer's or op's class name, for summaries
    op: bool = False  # a Keras op called on symbolic tensors (x[:, 0], keras.ops.add), not a layer


@dataclass(frozen=True)
class Graph:
    """Tensors, and nodes in a topological order; ``inputs``/``outputs`` are the model's (flat order)."""

    tensors: tuple
    nodes: tuple
    inputs: tuple
    outputs: tuple
    # units whose layers share variables (neither holding all the other's): a stage holding one holds all
    together: tuple = ()

    def __post_init__(self):
        check(self)

    def _producers(self) -> dict:
        producers = {t: MODEL_INPUT for t in self.inputs}
        for n, node in enumerate(self.nodes):
            producers.update({t: n for t in node.outputs})
        return producers


def check(graph: Graph) -> None:
    """Raises :class:`PipelineConfigError` unless every tensor is written once, before it is read."""
    written = set(graph.inputs)
    if len(written) != len(graph.inputs):
        raise PipelineConfigError(f"a model input appears twice among the inputs {list(graph.inputs)}")
    for node in graph.nodes:
        unknown = [t for t in node.inputs if t not in written]
        if unknown:
            raise PipelineConfigError(
                f"node {node.name!r} reads {[graph.tensors[t].name for t in unknown]} before any node writes them: "
                "the nodes are not in a topological order"
            )
        again = [t for t in node.outputs if t in written]
        if again:
            raise PipelineConfigError(f"node {node.name!r} writes {[graph.tensors[t].name for t in again]} again")
        written.update(node.outputs)
    missing = [t for t in graph.outputs if t not in written]
    if missing:
        raise PipelineConfigError(f"no node computes the model outputs {[graph.tensors[t].name for t in missing]}")


@dataclass(frozen=True)
class Crossing:
    """A tensor that crosses from the stage that computes it to the later stages that read it."""

    tensor: int
    source: int
    destinations: tuple
    gradient: bool  # its gradient comes back (floating point, and not a model input)


@dataclass(frozen=True)
class Stage:
    """What one stage runs, reads and hands on.

    ``inputs`` are the tensors it reads but does not compute, in the order
    its forward takes them: model inputs first (stage 0, from the data),
    then what it receives, by source stage and tensor number. ``outputs``
    are the tensors it hands on: each crossing it sends, then (last stage)
    the model outputs, in the model's order. ``units`` are the weights it
    holds.
    """

    index: int
    nodes: tuple
    inputs: tuple
    receives: tuple  # Crossings, in the order of ``inputs`` after the model inputs
    sends: tuple  # Crossings
    outputs: tuple
    units: tuple

    @property
    def model_inputs(self) -> tuple:
        """The model inputs this stage reads from the data (stage 0 only)."""
        return self.inputs[: len(self.inputs) - len(self.receives)]


@dataclass(frozen=True)
class Cut:
    """A graph cut into stages of ``sizes`` nodes each."""

    graph: Graph
    sizes: tuple
    stages: tuple
    crossings: tuple
    shared: dict = field(default_factory=dict)  # unit -> the stages holding it, where more than one


def cut(graph: Graph, sizes: Sequence[int]) -> Cut:
    """Cuts ``graph`` into stages of ``sizes[s]`` consecutive nodes.

    A stage may be empty (a model with fewer nodes than ranks): it reads and
    sends what its place asks (the first stage the model inputs, the last
    the model outputs, for the loss), and runs nothing.

    >>> g = chain_graph(3)
    >>> c = cut(g, [2, 1])
    >>> [x.tensor for x in c.crossings], c.stages[1].inputs, c.stages[1].outputs
    ([2], (2,), (3,))
    """
    sizes = check_sizes(sizes, len(graph.nodes), empty=True)
    bounds, start = [], 0
    for size in sizes:
        bounds.append(range(start, start + size))
        start += size
    stage_of = {n: s for s, nodes in enumerate(bounds) for n in nodes}
    last = len(sizes) - 1
    producers = graph._producers()

    def source(tensor: int) -> int:
        return 0 if producers[tensor] == MODEL_INPUT else stage_of[producers[tensor]]

    readers: dict[int, set] = {}
    for n, node in enumerate(graph.nodes):
        for t in node.inputs:
            readers.setdefault(t, set()).add(stage_of[n])
    for t in graph.outputs:
        readers.setdefault(t, set()).add(last)
    crossings = []
    for t in sorted(readers):
        destinations = tuple(sorted(s for s in readers[t] if s != source(t)))
        if destinations:
            gradient = graph.tensors[t].floating and producers[t] != MODEL_INPUT
            crossings.append(Crossing(t, source(t), destinations, gradient))
    stages = []
    for s, nodes in enumerate(bounds):
        receives = tuple(sorted((c for c in crossings if s in c.destinations), key=lambda c: (c.source, c.tensor)))
        sends = tuple(c for c in crossings if c.source == s)
        model_inputs = tuple(graph.inputs) if s == 0 else ()
        outputs = tuple(c.tensor for c in sends) + (tuple(graph.outputs) if s == last else ())
        units = tuple(dict.fromkeys(graph.nodes[n].unit for n in nodes if graph.nodes[n].unit is not None))
        for group in graph.together:
            if any(unit in group for unit in units):
                units = tuple(dict.fromkeys(units + tuple(group)))
        stages.append(
            Stage(s, tuple(nodes), model_inputs + tuple(c.tensor for c in receives), receives, sends, outputs, units)
        )
    holders: dict[str, list] = {}
    for stage in stages:
        for unit in stage.units:
            holders.setdefault(unit, []).append(stage.index)
    shared = {unit: tuple(where) for unit, where in holders.items() if len(where) > 1}
    return Cut(graph, tuple(sizes), tuple(stages), tuple(crossings), shared)


def check_sizes(sizes: Sequence[int], num_nodes: int, num_stages: int | None = None, empty: bool = False) -> list[int]:
    """Validates nodes per stage (``balance``): one entry per stage, positive integers covering every node.

    >>> check_sizes((3, 4), 7, 2)
    [3, 4]
    """
    if isinstance(sizes, str) or not hasattr(sizes, "__len__"):
        raise PipelineConfigError(
            f"balance={sizes!r}: give None (balance parameters), 'time' (balance measured time) "
            "or a list with the number of layers of each stage."
        )
    sizes = list(sizes)
    if num_stages is not None and len(sizes) != num_stages:
        raise PipelineConfigError(
            f"balance {sizes} has {len(sizes)} stages but the job has {num_stages} ranks; "
            f"give one entry per rank (mpirun -n {len(sizes)}) or use balance=None."
        )
    if any(not isinstance(b, int) or isinstance(b, bool) or b < (0 if empty else 1) for b in sizes):
        raise PipelineConfigError(f"balance {sizes} must hold positive integers: every stage needs a layer.")
    if sum(sizes) != num_nodes:
        raise PipelineConfigError(
            f"balance {sizes} covers {sum(sizes)} layers but the model has {num_nodes} "
            "(a leading keras.Input is not a layer)."
        )
    return sizes


def sizes_of_layers(graph: Graph, balance: Sequence[int], num_stages: int) -> list[int]:
    """Nodes per stage from ``balance``: nodes per stage, or layers per stage (op nodes ride with the next layer).

    A chain's ``balance`` counts its layers, as the user wrote them; Keras
    adds op nodes of its own to the graph (the ``not_equal`` that computes
    an ``Embedding``'s mask, say), which go to the stage of the layer after
    them.

    >>> g = Graph(
    ...     tuple(Tensor(f"t{i}", (None, 2), "float32") for i in range(4)),
    ...     (Node("op", (0,), (1,), op=True), Node("a", (0,), (2,), "a"), Node("b", (2, 1), (3,), "b")), (0,), (3,))
    >>> sizes_of_layers(g, [1, 1], 2)
    [2, 1]
    """
    layers = [n for n, node in enumerate(graph.nodes) if not node.op]
    balance = list(balance) if hasattr(balance, "__len__") and not isinstance(balance, str) else balance
    if isinstance(balance, list) and sum(b for b in balance if isinstance(b, int)) == len(layers) != len(graph.nodes):
        check_sizes(balance, len(layers), num_stages)
        sizes, position = [], 0
        for count in balance:
            end = layers[position + count - 1] + 1 if position + count < len(layers) else len(graph.nodes)
            sizes.append(end - sum(sizes))
            position += count
        return sizes
    return check_sizes(balance, len(graph.nodes), num_stages)


def balance_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous sizes, each at least 1, minimising the largest stage's summed cost.

    With fewer nodes than stages, one node per stage and the last stages
    empty (they receive the model's outputs and compute the loss; see
    :func:`cut`).

    >>> balance_by_cost([1, 1, 1, 1], 2)
    [2, 2]
    >>> balance_by_cost([5.0], 3)
    [1, 0, 0]
    """
    n = len(costs)
    if n < num_stages:
        return [1] * n + [0] * (num_stages - n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-cost splitting the first i nodes into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], choice[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = choice[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def sizes_before(graph: Graph, names: Sequence[str], num_stages: int) -> list[int]:
    """Nodes per stage when each stage after the first starts at the node named in ``names`` (``split_before``).

    >>> sizes_before(chain_graph(4), ["n2"], 2)
    [2, 2]
    """
    names = list(names)
    if len(names) != num_stages - 1:
        raise PipelineConfigError(
            f"split_before={names} starts {len(names) + 1} stages but the job has {num_stages}; name one node per "
            f"stage after the first ({num_stages - 1} names)."
        )
    positions = []
    known = [node.name for node in graph.nodes]
    for name in names:
        if name not in known:
            close = [k for k in known if name in k or k in name][:5]
            raise PipelineConfigError(
                f"split_before names {name!r}, which is no node of the model"
                + (f" (did you mean {close}?)" if close else "")
                + "; summary() lists the nodes."
            )
        positions.append(known.index(name))
    if positions != sorted(set(positions)) or (positions and positions[0] == 0):
        raise PipelineConfigError(
            f"split_before={names} must name nodes in the order they run, none of them the first "
            f"(their positions: {positions})."
        )
    bounds = [0, *positions, len(known)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def describe(c: Cut) -> list[str]:
    """What each stage runs and what crosses each boundary, for ``summary()``."""
    graph = c.graph
    lines = []
    for stage in c.stages:
        names = [graph.nodes[n].name for n in stage.nodes]
        shown = ", ".join(names) if len(names) <= 6 else ", ".join(names[:3] + ["..."] + names[-2:])
        lines.append(f"stage {stage.index}: {len(names)} nodes ({shown})")
        for crossing in stage.sends:
            tensor = graph.tensors[crossing.tensor]
            mask = " + mask" if tensor.mask is not None else ""
            back = "" if crossing.gradient else ", no gradient"
            to = ", ".join(map(str, crossing.destinations))
            lines.append(f"  -> stage {to}: {tensor.name} {tensor.shape} {tensor.dtype}{mask}{back}")
    for unit, stages in c.shared.items():
        lines.append(f"weights of {unit} on stages {', '.join(map(str, stages))} (gradients summed each step)")
    return lines


def chain_graph(num_nodes: int, shape=(None, 4), dtype: str = "float32") -> Graph:
    """The graph of a chain of ``num_nodes`` one-tensor nodes ``n0``, ``n1``, ... (for tests and examples)."""
    tensors = tuple(Tensor(f"t{i}", shape, dtype) for i in range(num_nodes + 1))
    nodes = tuple(Node(f"n{i}", (i,), (i + 1,), unit=f"n{i}") for i in range(num_nodes))
    return Graph(tensors, nodes, (0,), (num_nodes,))
