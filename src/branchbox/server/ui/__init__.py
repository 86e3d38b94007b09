"""The ``/ui`` page: every sandbox family as a live fork tree, fed by ``GET /v1/events``."""
