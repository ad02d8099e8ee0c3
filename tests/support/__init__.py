"""What the rooms share: helpers, the hostile tools, the servers and programs the tests drive."""
