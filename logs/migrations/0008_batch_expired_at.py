from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("logs", "0007_batch"),
    ]

    operations = [
        migrations.AddField(
            model_name="batch",
            name="expired_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
