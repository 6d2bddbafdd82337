"""ddrl's runtime: what the scripts share and a researcher does not edit, in modules named for their
concern (docs/design.md lists them). A script calls `ddrl.launch(args)`, the Run's methods, and the
modules by name, so a reader sees which lines are the algorithm and which are plumbing."""

from ddrl.run import Run, launch

__all__ = ["Run", "launch"]
