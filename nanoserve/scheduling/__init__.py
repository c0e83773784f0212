"""The scheduler's chapters (seeds 001, 002 and 004): swap preemption and priority scheduling subclass the core's
Scheduler (nanoserve/engine/scheduler.py), naming what they change; async scheduling runs the core's steps through
vLLM's batch queue. nanoserve/chapters.py plugs in the ones the config asks for."""
