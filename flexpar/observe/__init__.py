"""What a job reports and how it is shown: metrics records and their schema, the live display,
the timeline plot and the experiment trackers."""
