"""Shared algorithm implementations (torch only): DDP, DiLoCo, Pier, GASLoC, pipelines."""
