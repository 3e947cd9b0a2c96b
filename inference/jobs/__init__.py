"""The Celery worker's jobs (documents, images) and the feed their progress travels on; the
web process enqueues them and reads the feed, the Celery worker runs them."""
