"""Experiments, batches and the step loop: engine + store under one experiment lock.

    domain.py       the server's own types (config, experiment, task, batch, ...)
    limits.py       every bound on what a request may carry
    validation.py   checks of every input value against them
    experiment.py   an experiment held in memory (posterior arrays, keys)
    runtime.py      worker threads, the experiments in memory, loading and catching up
    database.py     is the database answering? (a hung one is noticed by a timed ping)
    experiments.py  create, get, list, delete, fork, restore, snapshot
    pool.py         adding tasks
    batches.py      selecting batches and applying reports
    checkpoints.py  writing the posterior to the store
    observer.py     hooks for metrics
    selector.py     SelectorService: the above, wired together
"""
