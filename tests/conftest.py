"""Shared test configuration: Hypothesis profile sized by HMACORE_EXAMPLES (CI: 2000)."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "hmacore",
    max_examples=int(os.environ.get("HMACORE_EXAMPLES", "2000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("hmacore")
