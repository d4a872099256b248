"""Local launchers: processes on this machine for ``fusion demo``, the tests and the testbeds.

- :mod:`~fusion.launch.processes`: the one way a child is started, waited for, logged and
  stopped (:class:`ProcessGroup`, :func:`child_env`);
- :mod:`~fusion.launch.forkserver`: children forked from a warm interpreter that has
  already imported torch (``FUSION_FORK_SERVER=1``);
- :mod:`~fusion.launch.fleet`: a coordinator and fusion workers (:class:`Fleet`);
- :mod:`~fusion.launch.executors`: bare executors without a coordinator (``LocalCluster``);
- :mod:`~fusion.launch.distributed`: a training run over such executors (``train_distributed``).

The package exports what loads neither torch nor gRPC; import ``LocalCluster`` and
``train_distributed`` from their modules.
"""

from fusion.launch.fleet import Fleet
from fusion.launch.processes import REPO_ROOT, ProcessGroup, child_env

__all__ = ["REPO_ROOT", "Fleet", "ProcessGroup", "child_env"]
