"""A ValidatingAdmissionPolicy run as kube-apiserver runs it, for the API twin (tests/kubeapi.py): its
matchConditions, then its variables and validations, CEL expressions evaluated with cel-python (the CEL
specification's Python implementation) on ``object``, ``oldObject`` and ``request``. What Kubernetes adds to
CEL beyond the standard macros is not here: a policy that needs it fails to compile in the test that loads it."""

from __future__ import annotations

import celpy


class Policy:
    """``deny(old, new, username)`` -> the first failing validation's message, or None (admitted)."""

    def __init__(self, doc: dict):
        env = celpy.Environment()
        spec = doc["spec"]
        self.name = doc["metadata"]["name"]
        self._match = [env.program(env.compile(c["expression"])) for c in spec.get("matchConditions", [])]
        self._vars = [(v["name"], env.program(env.compile(v["expression"]))) for v in spec.get("variables", [])]
        self._checks = [(env.program(env.compile(v["expression"])), v.get("message", v["expression"]))
                        for v in spec["validations"]]  # fmt: skip

    def deny(self, old: dict, new: dict, username: str) -> str | None:
        act = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old),
               "request": celpy.json_to_cel({"userInfo": {"username": username}, "operation": "UPDATE"})}  # fmt: skip
        if not all(bool(m.evaluate(act)) for m in self._match):
            return None  # not this policy's request
        variables = {}
        for name, prog in self._vars:
            variables[name] = prog.evaluate({**act, "variables": celpy.json_to_cel(variables)})
        act["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
        for prog, message in self._checks:
            if not bool(prog.evaluate(act)):
                return f"ValidatingAdmissionPolicy '{self.name}' denied request: {message}"
        return None
