"""pdserve autoscaler: a pure per-role scaling policy, a control loop, and actuators behind one contract.

    from autoscaler import AutoscalerConfig, ControlLoop, RoleLoad, make_actuator
    loop = ControlLoop(AutoscalerConfig(), observe=gateway_loads, actuator=make_actuator("kubernetes"))
    loop.start()   # ... loop.status() for `pdserve status`; loop.stop()

Backends (local, kubernetes, fake) are imported only when `make_actuator` asks for them.
"""

from .actuator import (
    Actuator,
    ActuatorError,
    NodeInfo,
    PermanentActuatorError,
    TemporaryActuatorError,
    actuator_kinds,
    make_actuator,
)
from .backoff import Backoff, Throttler, retry
from .config import ROLES, AutoscalerConfig
from .loop import ControlLoop, TickReport
from .policy import Decision, PolicyContext, PolicyState, RoleDecision, RoleLoad, decide

__all__ = [
    "ROLES", "Actuator", "ActuatorError", "AutoscalerConfig", "Backoff", "ControlLoop", "Decision", "NodeInfo",
    "PermanentActuatorError", "PolicyContext", "PolicyState", "RoleDecision", "RoleLoad", "TemporaryActuatorError",
    "Throttler", "TickReport", "actuator_kinds", "decide", "make_actuator", "retry",
]  # fmt: skip
