"""The template topology (examples/torus_topology.py) is what docs/DESIGN.md says: one
file that registers itself by name, whose graph the base class turns into gossip weights,
and which the algorithms take by that name. Each check runs in a fresh interpreter, so the
registration never leaks into the other tests' registry."""

import os
import subprocess
import sys
import textwrap


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "torus_topology.py")


def _python(code: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "examples"), ROOT])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_torus_registers_by_name_and_builds_the_graph_its_docstring_states():
    out = _python("""
        import topologies
        assert "torus" not in topologies.available_topologies()
        import torus_topology
        from topologies import get_topology
        assert "torus" in topologies.available_topologies()
        assert "torus" not in topologies.available_topologies(trees_only=True)
        t = get_topology("torus", 12)            # a 3 x 4 grid
        assert type(t) is torus_topology.TorusTopology
        assert torus_topology.grid_shape(12) == (3, 4)
        assert sorted(t.neighbors(0)) == [1, 3, 4, 8]
        assert sorted(t.neighbors(5)) == [1, 4, 6, 9]
        assert t.diameter() == 3 and t.is_connected() and not t.is_tree()
        W = t.gossip_matrix()
        assert all(abs(sum(row) - 1) < 1e-12 for row in W)
        assert all(W[i][j] == W[j][i] for i in range(12) for j in range(12))
        assert torus_topology.grid_shape(7) == (1, 7)   # a prime: a ring
        assert sorted(get_topology("torus", 7).neighbors(0)) == [1, 6]
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_taken_name_is_refused_and_a_bad_class_named():
    out = _python("""
        import pytest
        from topologies import RingTopology, Topology, register_topology
        class Other(Topology):
            name = "ring"
            def _candidate_neighbors(self, rank): return []
        with pytest.raises(ValueError, match="taken by topologies.gossip.RingTopology"):
            register_topology(Other)
        assert register_topology(RingTopology) is RingTopology   # the same class again: a no-op
        class Nameless(Topology):
            def _candidate_neighbors(self, rank): return []
        with pytest.raises(ValueError, match="class attribute name"):
            register_topology(Nameless)
        with pytest.raises(TypeError, match="Topology subclass"):
            register_topology(object)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_example_trains_over_the_torus_by_name_and_it_mixes_faster_than_the_ring():
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, EXAMPLE, "--workers", "16", "--steps", "20"], capture_output=True,
                          text=True, env=env, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": consensus distance after 20 steps ") for line in done.stdout.splitlines()
                 if "consensus distance" in line)
    assert float(lines["torus"]) < float(lines["ring"])
