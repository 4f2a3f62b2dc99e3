"""Stop strings in generated text: where one begins, and how much text may stream before one.

Pure string work, kept apart from :mod:`kvfence.model.sampling` (which needs torch) so that the
control plane, which checks stop strings but never samples, does not load torch.
:mod:`kvfence.model.sampling` re-exports both functions for its callers.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index in ``text`` where the earliest stop string begins, or None.

    With ``start``, only occurrences that end after ``start`` are looked for: a caller that found
    none in ``text[:start]`` before, and whose text only grew since, gets the same answer as a
    search of the whole text at the cost of the new part (plus the longest stop string)."""
    hits = []
    for s in stops:
        lo = start - len(s) + 1
        i = text.find(s, lo) if start > 0 and lo > 0 else text.find(s)
        if i >= 0:
            hits.append(i)
    return min(hits) if hits else None


_PROBE = 4  # characters at the end of the text that stream_safe_len looks up in a stop string


def stream_safe_len(text: str, stops: Sequence[str]) -> int:
    """How much of ``text`` can be streamed now: a trailing incomplete character (shown as U+FFFD)
    or a suffix that could still grow into a stop string is held back.

    The hold is the longest suffix of ``text`` (before the trailing U+FFFD, shorter than the stop
    string) that is a prefix of some stop string. Per stop string only the text's last
    ``len(s) - 1`` characters matter: a suffix of ``k >= 4`` of them ends with the text's last 4,
    so it can only be one that ends where those 4 occur in ``s`` (``str.rfind``, longest first),
    checked with ``str.startswith``; shorter ones are tried directly. Per call, work bounded by the
    stop strings, not by the text (before, every suffix of every stop string was sliced)."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    tail = text[max(0, end - _PROBE) : end]
    for s in stops:
        longest = min(len(s) - 1, end)  # an empty stop string holds nothing back
        if longest <= hold:
            continue  # cannot hold back more than is already held
        width = min(_PROBE, longest)
        probe = tail[len(tail) - width :]
        found = 0
        j = s.rfind(probe, 0, longest)  # s[j : j + width] == probe, j + width <= longest
        while j >= 0 and j + width > hold:
            if text.startswith(s[:j], end - width - j):  # then text[end-k:end] == s[:k]
                found = j + width
                break
            j = s.rfind(probe, 0, j + width - 1)  # the next occurrence to the left
        if not found:  # shorter than the probe: they begin with s[0]
            i = text.find(s[0], end - width + 1, end)
            while i >= 0 and end - i > hold:
                if text.startswith(s[: end - i], i):
                    found = end - i
                    break
                i = text.find(s[0], i + 1, end)
        hold = max(hold, found)
    return end - hold
