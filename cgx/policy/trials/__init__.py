"""The deciding exchange (``Compression.auto(objective="time")``, and ``Compression.planned()``
at its fixed level): the model proposes whole exchange plans (proposals.py; planned.py for
the planned mode), trials run them and the ranks agree on the measured steps (trials.py),
the fastest within the error budget travels and is watched (decider.py)."""

from cgx.policy.trials.decider import Decider, TrialDecider
from cgx.policy.trials.planned_decider import PlannedDecider
from cgx.policy.trials.proposals import Proposal, propose, select
from cgx.policy.trials.rounds import (Event, Phase, PlanRecord, Trials, choose, format_round,
                                 format_trials)

__all__ = ["Decider", "Event", "Phase", "PlanRecord", "PlannedDecider", "Proposal",
           "TrialDecider", "Trials", "choose", "format_round", "format_trials", "propose", "select"]
