"""The deciding exchange (``Compression.auto(objective="time")``, and ``Compression.planned()``
at its fixed level): the model proposes whole exchange plans (proposals.py; planned.py for
the planned mode), trials run them and the ranks agree on the measured steps (trials.py),
the fastest within the error budget travels and is watched (decider.py)."""

from cgx.deciding.decider import Decider, TrialDecider
from cgx.deciding.planned import PlannedDecider
from cgx.deciding.proposals import Proposal, propose, select
from cgx.deciding.trials import (Event, Phase, PlanRecord, Trials, choose, format_round,
                                 format_trials)

__all__ = ["Decider", "Event", "Phase", "PlanRecord", "PlannedDecider", "Proposal",
           "TrialDecider", "Trials", "choose", "format_round", "format_trials", "propose", "select"]
