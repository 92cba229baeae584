"""The GPU expert cache's decisions, separated as measure / decide / apply:

- measure: usage profiles (:mod:`.profile`), routing traces replayed
  through the policy (:mod:`.simulate`), synthetic traces fitted to a
  hit-rate curve (:mod:`.traces`);
- decide: slots per layer under one byte budget (:mod:`.plan`);
- apply: per layer and step, which experts hit, which enter and which leave
  (:mod:`.policy`).

None of it touches weights or a GPU; the engine moves the expert weights the
admissions name.
"""
from .batched import BatchedCache
from .plan import plan_slots
from .policy import Admission, CachePolicy, LayerCache
from .profile import Profile, load_profile, model_fingerprint, profile_from_scores, save_profile
from .simulate import SimResult, simulate, trace_from_capture, warm_caches

__all__ = ["Admission", "BatchedCache", "CachePolicy", "LayerCache", "plan_slots", "Profile", "load_profile",
           "save_profile", "model_fingerprint", "profile_from_scores", "SimResult", "simulate", "trace_from_capture",
           "warm_caches"]
