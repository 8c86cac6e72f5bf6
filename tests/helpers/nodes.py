"""The session's two simulated Ray nodes (tests/conftest.py ``ray_cluster``): each has a custom
resource only it holds, so a test pins work to one of them with ``{NODE_A: amount}`` or
``{NODE_B: amount}`` and checks where it ran with :func:`node_holding`."""

NODE_A = "flotilla_test_node_a"  # the head node
NODE_B = "flotilla_test_node_b"  # the second node
NODE_B_CPUS = 2


def node_holding(resource: str) -> str:
    """The node id of the (one) live node holding ``resource``."""
    import ray

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)]
    assert len(nodes) == 1, f"expected one node holding {resource!r}, found {nodes}"
    return nodes[0]
