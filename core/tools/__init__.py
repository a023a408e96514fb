"""The longer ``infergraft`` subcommands: ``chat``, ``plan`` (``plan_cli``), ``bench``
(``bench``, ``bench_cli``) and the CUDA step profile (``bench_profile``)."""
