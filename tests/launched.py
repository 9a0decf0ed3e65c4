"""What a failed `torchrun` launch says about its ranks."""

from subprocess import CompletedProcess

_AGENT = "/distributed/elastic/"  # the path in the agent's own log lines


def rank_errors(done: CompletedProcess) -> str:
    """The ranks' own last words before torchrun's report of their failure (which alone
    names only the signal), then the end of that report: what a failed launch's assertion
    should show."""
    stderr = str(done.stderr)
    cut = stderr.find(_AGENT)
    ranks = stderr if cut < 0 else stderr[:stderr.rfind("\n", 0, cut) + 1]
    return f"{ranks[-3000:]}\n--- torchrun:\n{stderr[-1000:]}"
