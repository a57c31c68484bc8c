# The two commands of the README contract. Each installs what it needs first.
.PHONY: up check lint test

# Weir's main job: a local fleet (Redis, reference engines, sidecars, router) serving requests.
up:
	@scripts/bootstrap.sh run
	.venv/bin/weir up $(ARGS)

# Every check: format, lint, types, import contracts, tests.
check:
	@scripts/bootstrap.sh dev
	@scripts/check.sh

lint:
	@scripts/bootstrap.sh dev
	@scripts/check.sh --no-tests

test:
	@scripts/bootstrap.sh dev
	.venv/bin/pytest $(ARGS)
