"""Exceptions of the remat client library.

Hierarchy::

    RematError                      base of everything remat raises on purpose
    ├── TraceFormatError            a trace file or object breaks the remat-trace/1 contract (also ValueError)
    ├── PlanError                   a plan cannot be computed or used (also ValueError)
    │   ├── InvalidKeyError         a plan key field (hash, input shape, dtype, device, ...) is malformed
    │   ├── PlanMismatchError       a plan's key does not match the model it is applied to
    │   │   └── StalePlanError      a plan of this very key names cuts of another chain or op graph
    │   └── PlanNotFoundError       the plan service has no plan for the key
    ├── ServiceError                the plan service could not be reached or answered an error
    └── ModelError                  a model cannot be resolved, traced or cut into stages (also ValueError)
        └── UnknownModelError       a zoo name that torchvision does not know

The CLI turns every ``RematError`` raised because of user input into a one-line message and exit code 2.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class of the errors remat raises deliberately."""


class TraceFormatError(RematError, ValueError):
    """A trace does not follow ``remat-trace/1``; the message names the offending field."""


class PlanError(RematError, ValueError):
    """A plan cannot be computed, parsed or used as asked."""


class InvalidKeyError(PlanError):
    """A plan key component is malformed or out of range; the message starts with the field name."""


class PlanMismatchError(PlanError):
    """A plan was computed for another model, input signature or convention than the one at hand."""


class StalePlanError(PlanMismatchError):
    """A plan made for this very key whose boundaries or vertices name another stage chain or op graph than the
    model is cut into now: an older remat cut the model otherwise. ``checkpoint`` plans such a model again."""


class PlanNotFoundError(PlanError):
    """The service answered, but has no plan for the key; the message names the key and how to create one."""


class ServiceError(RematError):
    """Transport or protocol failure talking to a remat service."""


class ModelError(RematError, ValueError):
    """A model cannot be resolved, traced or cut into a chain of stages; the message says why in one line."""


class UnknownModelError(ModelError):
    """A model name that the zoo does not know; the message lists close matches."""
