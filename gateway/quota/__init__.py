"""Per-key quotas: requests and tokens per clock minute and streams at once, in this process or in
Redis shared by the replicas (see gate.py for the store-down policy)."""

from gateway.quota.estimate import reservation
from gateway.quota.gate import Admission, Quotas
from gateway.quota.policy import QuotaPolicy, policy_for

__all__ = ["Admission", "QuotaPolicy", "Quotas", "policy_for", "reservation"]
