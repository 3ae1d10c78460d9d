"""Every run-config field has exactly one rule for what a resume does with a changed value."""

from megaloop.training.resume import SCHEDULE_FIELDS


def test_every_run_config_field_has_one_resume_rule():
    import dataclasses

    from megaloop.config import RunConfig
    from megaloop.training import checkpoint as ckpt
    from megaloop.training import finished, resume

    fields = [f"{s.name}.{f.name}" for s in dataclasses.fields(RunConfig)
              for f in dataclasses.fields(s.type if isinstance(s.type, type) else
                                          type(getattr(RunConfig(), s.name)))]
    rules = [*(f"model.{k}" for k in ckpt.ARCHITECTURE_FIELDS), *resume.REPORTED_BY_TRAINER,
             *resume.APPLIED, *resume.BOOKKEEPING, *resume.NOT_APPLICABLE,
             *resume.AT_NEXT_ALLOCATION, *resume.AT_START, *resume.OWN_RULES]
    assert sorted(rules) == sorted(fields)  # each field once
    assert {f"train.{k}" for k in SCHEDULE_FIELDS} <= set(resume.REPORTED_BY_TRAINER)
    # What a finished run's missing final evaluation applies: settings, none a location.
    assert set(finished.VALIDATION_READS + finished.DOWNSTREAM_READS) <= set(fields) - set(
        resume.LOCATIONS)
