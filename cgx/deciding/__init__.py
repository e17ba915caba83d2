"""The deciding exchange (``Compression.auto(objective="time")``): the model proposes whole
exchange plans (proposals.py), trials run them and the ranks agree on the measured steps
(trials.py), the fastest within the error budget travels and is watched (decider.py)."""

from cgx.deciding.decider import Decider
from cgx.deciding.proposals import Proposal, propose, select
from cgx.deciding.trials import Event, Phase, PlanRecord, Trials, choose, format_trials

__all__ = ["Decider", "Event", "Phase", "PlanRecord", "Proposal", "Trials", "choose",
           "format_trials", "propose", "select"]
