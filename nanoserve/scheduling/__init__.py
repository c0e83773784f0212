"""The scheduler's chapters, as vLLM v0.6.3's scheduler, vLLM's async scheduling and early vLLM's
block manager describe them: swap preemption and priority scheduling subclass the core's Scheduler
(nanoserve/engine/scheduler.py), naming what they change; async scheduling runs the core's steps
through vLLM's batch queue. nanoserve/chapters.py plugs in the ones the config asks for."""
