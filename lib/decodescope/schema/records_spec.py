"""Typed record of the drafter's passes in a speculative step, as one profiled level measured them:
data/profile/c<N>/drafter_steps.json (trace.draftsteps).

decodescope.schema.records says how records are versioned, read and written.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from decodescope.schema.recordbase import Record


class DrafterSteps(Record):
    """Where a speculative step's drafter spent its time on the critical rank, medians over decode steps.
    The step's own annotation is the verify pass; the drafter runs after it, outside it, one model forward
    a draft token. All times are as profiled (the profiler's own cost included)."""

    concurrency: Optional[int] = Field(None, description="the profiled level")
    rank: int = Field(description="the rank these medians are of: the one with the longest drafter")
    steps: int = Field(description="decode steps with draft passes after them")
    passes: int = Field(description="draft passes a step (the median): num_speculative_tokens")
    verify_us: float = Field(description="the verify pass: the step's annotation")
    lead_us: float = Field(description="the verify's end to the first draft forward: the rejection sampler "
                                       "and the first pass's inputs")
    first_pass_us: float = Field(description="the first draft forward's start to the second's (to the drafter's "
                                             "end at one pass): it also takes the tokens the verify accepted")
    next_pass_us: Optional[float] = Field(None, description="each later pass, start to start (the last to the "
                                          "drafter's end); None at one pass")
    forward_us: float = Field(description="one draft forward and its logits (Dynamo's prologue to the argmax), all passes")
    drafter_us: float = Field(description="the verify's end to the drafter's end: lead and passes")
    between_us: float = Field(description="the drafter's end to the next step's start")
