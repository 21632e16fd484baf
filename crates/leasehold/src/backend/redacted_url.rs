//! A Redis URL fit for an error message: its password replaced by `***`.
//!
//! Errors end up in logs and on terminals; a URL that failed to parse is exactly the one a user
//! copies into a bug report.

/// `url` with the password of its user-info (`user:password@`) and any `pass=` / `password=`
/// query value (the form `redis+unix://` URLs use) replaced by `***`. Everything else is kept, so
/// the message still shows what is wrong with the URL.
pub(crate) fn redacted(url: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let mut out = match head.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let authority = match authority.rsplit_once('@') {
                Some((userinfo, host)) => match userinfo.split_once(':') {
                    Some((user, _password)) => format!("{user}:***@{host}"),
                    None => authority.to_string(),
                },
                None => authority.to_string(),
            };
            format!("{scheme}://{authority}{path}")
        }
        None => head.to_string(),
    };
    if let Some(query) = query {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) if key == "pass" || key == "password" => format!("{key}=***"),
                _ => pair.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&pairs.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_are_hidden_and_the_rest_is_kept() {
        let cases = [
            (
                "redis://admin:s3cret@127.0.0.1:6379/x",
                "redis://admin:***@127.0.0.1:6379/x",
            ),
            ("rediss://:s3cret@host/0", "rediss://:***@host/0"),
            ("redis://a:b:c@d@host", "redis://a:***@host"),
            ("redis://user@host:1/", "redis://user@host:1/"),
            ("redis://127.0.0.1:6379/", "redis://127.0.0.1:6379/"),
            (
                "redis+unix:///tmp/r.sock?db=1&pass=s3cret",
                "redis+unix:///tmp/r.sock?db=1&pass=***",
            ),
            ("not a url", "not a url"),
        ];
        for (url, shown) in cases {
            assert_eq!(redacted(url), shown, "{url}");
            assert!(!redacted(url).contains("s3cret"));
        }
    }
}
