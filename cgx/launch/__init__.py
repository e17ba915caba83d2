"""Starting a job and finding one's place in it.

- :mod:`cgx.launch.world`: who am I (rank, size, local and cross ranks, rank 0's
  address) from the launcher's environment (horovodrun, torchrun, Open MPI,
  MPICH, Slurm).
- :mod:`cgx.launch.layout`: the node layout, checked against the ranks' host names.
- :mod:`cgx.launch.addresses`: the address other hosts reach this one at
  (interfaces, routes, host names).
- :mod:`cgx.launch.rendezvous`: rank 0's address and the store the ranks meet at.
- :mod:`cgx.launch.secret`, :mod:`cgx.launch.gate`: the job's secret and the
  admission on that store (only ranks that prove the secret join).
- :mod:`cgx.launch.cli`: the ``cgxrun`` command (parser, checks, the ranks'
  environment), over :mod:`~cgx.launch.torchrun` (``--gloo``) and
  :mod:`~cgx.launch.mpirun` (``--mpi``); :mod:`~cgx.launch.spec` holds the parsed
  command line.
- :mod:`cgx.launch.exit_record`: which rank failed first, and with what code.

Nothing here imports torch, the transports or the engine at module level:
``cgxrun`` and ``import cgx`` stay cheap.
"""
