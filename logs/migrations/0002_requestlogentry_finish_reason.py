from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("logs", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestlogentry",
            name="finish_reason",
            field=models.CharField(blank=True, default="", max_length=20),
        ),
    ]
