"""The seams the API and the workers talk through: publishing jobs to the broker (and the dispatch relay that
keeps the store in step), the token stream of a running job, and the notification that a job finished."""
