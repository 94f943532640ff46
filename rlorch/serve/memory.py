"""``/release_memory_occupation`` and ``/resume_memory_occupation`` of `rlorch serve`, as SGLang
0.5.23 defines them (tags ``kv_cache``, ``weights``, ``cuda_graph``; none or ``[]`` means all;
success is 200 with body ``null``), so a colocated run's swap step drives either engine.

Where SGLang's scheduler dies (a release while requests run, a resume of a tag never released,
generation while memory is released), this engine answers 400 naming the problem and keeps
serving: the client must not rely on either, and the contract tests hold it to SGLang's order.

On a GPU a released ``weights`` tag moves the model to the host (SGLang with
``--enable-weights-cpu-backup`` keeps such a copy) and a resume moves it back; ``kv_cache`` holds
nothing between requests here (each batch builds its cache), so its release only returns the
allocator's cached blocks to the device. On the CPU the tags are state alone.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

TAGS = ("kv_cache", "weights", "cuda_graph")


class OccupationError(ValueError):
    """A release or resume refused: the message says why, the state is unchanged."""


def parse_tags(raw: Any) -> tuple[str, ...]:
    """A request's ``tags``: None or empty means every tag; anything else must be known tags."""
    if raw is None or raw == []:
        return TAGS
    if not isinstance(raw, list) or not all(isinstance(tag, str) for tag in raw):
        raise OccupationError("tags must be a list of strings")
    unknown = [tag for tag in raw if tag not in TAGS]
    if unknown:
        raise OccupationError(f"unknown tags {unknown}: use {list(TAGS)}")
    return tuple(dict.fromkeys(raw))


class MemoryOccupation:
    """Which tags are released, and the moves each makes on ``model`` (on ``device``)."""

    def __init__(self, model, device: str):
        self.model = model
        self.device = device
        self.released: set[str] = set()

    def describe(self) -> Optional[str]:
        """What a refused generation, continue or weight update is told (None: nothing released)."""
        if not self.released:
            return None
        return (f"memory released ({', '.join(sorted(self.released))}): resume it with "
                "/resume_memory_occupation first")

    def release(self, tags: tuple[str, ...], busy: Callable[[], Optional[str]]) -> None:
        """Release ``tags``; ``busy`` names the requests that forbid it (SGLang asserts the
        scheduler is idle, waiting requests allowed while paused)."""
        reason = busy()
        if reason:
            raise OccupationError(f"release_memory_occupation should be called only when the server is idle: {reason}")
        if "weights" in tags and "weights" not in self.released:
            self._move("cpu")
        self.released.update(tags)
        self._return_cached_blocks()

    def resume(self, tags: tuple[str, ...]) -> None:
        """Resume ``tags``, each of which must have been released."""
        never = [tag for tag in tags if tag not in self.released]
        if never:
            raise OccupationError(f"cannot resume {never}: not released (released: {sorted(self.released)})")
        if "weights" in tags:
            self._move(self.device)
        self.released.difference_update(tags)

    def _move(self, device: str) -> None:
        if self.device != "cpu":
            self.model.to(device)

    def _return_cached_blocks(self) -> None:
        if self.device != "cpu":
            import torch

            torch.cuda.empty_cache()
