"""NetworkPolicy semantics for the tests: may a pod with these labels (in this namespace) open a connection to
a pod with those labels on this port? What a CNI enforces (networking.k8s.io/v1), for the selectors pdserve's
manifests use: podSelector and namespaceSelector with matchLabels / matchExpressions (In, NotIn, Exists,
DoesNotExist), ports by number or name. Written by hand: no library evaluates NetworkPolicies offline."""

from __future__ import annotations


def selects(selector: dict | None, labels: dict) -> bool:
    """A label selector; {} selects everything, None nothing."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", ()), "NotIn": not has or value not in e.get("values", ()),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]  # fmt: skip
        if not ok:
            return False
    return True


def _peer_allows(peer: dict, src: dict, src_ns: dict, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        return False  # pods, not addresses, in these tests
    ns_ok = selects(peer["namespaceSelector"], src_ns) if "namespaceSelector" in peer else \
        src_ns.get("kubernetes.io/metadata.name") == policy_ns  # fmt: skip
    return ns_ok and selects(peer.get("podSelector", {}), src)


def _port_allows(ports: list[dict] | None, port: int, port_name: str | None) -> bool:
    return not ports or any(p.get("port") in (None, port, port_name) for p in ports)


def allowed(policies: list[dict], src: dict, src_ns: str, dst: dict, dst_ns: str, port: int,
            port_name: str | None = None) -> bool:  # fmt: skip
    """Whether ingress to `dst` (labels, namespace) from `src` on `port` is allowed by `policies`."""
    ns_labels = {"kubernetes.io/metadata.name": src_ns}
    applying = [p for p in policies if p["kind"] == "NetworkPolicy" and p["metadata"].get("namespace", dst_ns) == dst_ns
                and selects(p["spec"]["podSelector"], dst)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]  # fmt: skip
    if not applying:
        return True  # no policy selects the pod: all ingress allowed
    return any(_port_allows(rule.get("ports"), port, port_name)
               and (not rule.get("from") or any(_peer_allows(peer, src, ns_labels, dst_ns) for peer in rule["from"]))
               for p in applying for rule in p["spec"].get("ingress") or [])  # fmt: skip
