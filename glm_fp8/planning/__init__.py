"""Before anything runs: a deployment sized and timed (``glm-fp8 plan``'s report as a library).
A fleet of vLLM servers (``fleet``), the request (``request``), the memory model (``memory``), the
update-time model (``update_time``, its delta mode ``update_delta``), the report's sections
(``summary``, ``deployment``), the report (``report``: ``plan_report``) and its text (``text``:
``format_plan_report``). Reads the model, kernel, engine and transfer layers; runs none of them."""

from glm_fp8.planning.fleet import Fleet, MegatronTrainer, Server, fleet_preset
from glm_fp8.planning.report import plan_report
from glm_fp8.planning.request import PlanRequest
from glm_fp8.planning.text import format_plan_report
from glm_fp8.planning.update_delta import Delta
from glm_fp8.planning.update_time import predict

__all__ = [
    "Delta",
    "Fleet",
    "MegatronTrainer",
    "PlanRequest",
    "Server",
    "fleet_preset",
    "format_plan_report",
    "plan_report",
    "predict",
]
